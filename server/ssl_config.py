"""TF Serving's --ssl_config_file: an SSLConfig text file holding the PEM texts themselves
(`server_key`, `server_cert`, `custom_ca`, `client_verify`), read as TF Serving reads it. As in TF
Serving, it secures the gRPC port only; the REST port stays plain HTTP (our own --tls-* flags
cover both)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format

from protos.tensorflow_serving import ssl_config_pb2


@dataclass(frozen=True)
class SslConfig:
    key: bytes
    cert: bytes
    client_ca: bytes | None
    """Client certificates must chain to it (None: none are asked for)."""


def read_ssl_config(path: str) -> SslConfig:
    """ValueError (the server exits 2) names what is wrong with the file."""
    where = f"--ssl_config_file {path}"
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {where}: {exc.strerror or exc}") from None
    config = ssl_config_pb2.SSLConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ValueError(f"{where} is not an SSLConfig: {exc}") from None
    for field in ("server_key", "server_cert"):
        if "-----BEGIN " not in getattr(config, field):
            raise ValueError(f"{where}: {field} must hold the PEM text itself (-----BEGIN ...), not a file name")
    if config.client_verify and "-----BEGIN " not in config.custom_ca:
        raise ValueError(f"{where}: client_verify needs custom_ca, the PEM CA bundle client certificates chain to")
    return SslConfig(config.server_key.encode(), config.server_cert.encode(),
                     config.custom_ca.encode() if config.client_verify else None)
