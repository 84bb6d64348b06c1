"""TF Serving's --ssl_config_file: an SSLConfig text file holding the PEM texts themselves
(`server_key`, `server_cert`, `custom_ca`, `client_verify`), read as TF Serving reads it. As in TF
Serving, it secures the gRPC port only; the REST port stays plain HTTP (our own --tls-* flags
cover both)."""

from __future__ import annotations

from dataclasses import dataclass

from protos.tensorflow_serving import ssl_config_pb2
from server.frontends import text_proto


@dataclass(frozen=True)
class SslConfig:
    key: bytes
    cert: bytes
    client_ca: bytes | None
    """Client certificates must chain to it (None: none are asked for)."""


def read_ssl_config(path: str) -> SslConfig:
    """ValueError (the server exits 2) names what is wrong with the file."""
    where = f"--ssl_config_file {path}"
    config = text_proto.read(path, ssl_config_pb2.SSLConfig, "--ssl_config_file")
    for field in ("server_key", "server_cert"):
        if "-----BEGIN " not in getattr(config, field):
            raise ValueError(f"{where}: {field} must hold the PEM text itself (-----BEGIN ...), not a file name")
    if config.client_verify and "-----BEGIN " not in config.custom_ca:
        raise ValueError(f"{where}: client_verify needs custom_ca, the PEM CA bundle client certificates chain to")
    return SslConfig(config.server_key.encode(), config.server_cert.encode(),
                     config.custom_ca.encode() if config.client_verify else None)
