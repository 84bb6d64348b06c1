"""Who may change what the server runs, and where models may come from.

A SavedModel is code: its signatures can read and write files with the server's rights. So a
call that loads or removes models (TF Serving's HandleReloadConfigRequest; Triton's repository
calls later) is refused unless all three hold:

1. the server was started with --enable-model-management (else PERMISSION_DENIED, naming it);
2. the call carries `authorization: Bearer TOKEN` with a token of --admin-token-file, compared in
   constant time (else UNAUTHENTICATED), or comes over mutual TLS with an admin's client
   certificate: one whose subject common name or a subjectAltName is on a `client-certificate
   NAME` line of that file, or one issued by a certificate of --admin-client-ca-file. Inference
   clients hold certificates of --tls-client-ca-file too, so any other certificate is
   PERMISSION_DENIED, logged with its names;
3. every base path it names resolves, symlinks followed, inside a --model-root (by default the
   folders holding the start-up models); else INVALID_ARGUMENT, checked before the path is looked
   at, so the answer does not tell whether it exists.

Every such call is logged with its peer, who it was (the token's name, never the token; or the
certificate's names) and its outcome. TF Serving leaves its ModelService open to anyone who
reaches the port; this server does not.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.serialization import Encoding

from server.core.model_config import ModelSource
from server.errors import InvalidInput, PermissionDenied, Unauthenticated

log = logging.getLogger("server.control")

BEARER = "bearer "


CERTIFICATE_LINE = "client-certificate"
"""An admin token file's line `client-certificate NAME` names an admin's client certificate."""


@dataclass(frozen=True)
class Admins:
    tokens: dict[str, str]
    """token -> the name logged for it."""
    certificates: frozenset[str] = frozenset()
    """Subject common names or subjectAltNames of admins' client certificates."""


def read_admins(path: str) -> Admins:
    """The admin token file: one token per line, or 'NAME TOKEN', or 'client-certificate NAME'
    (a client certificate's subject common name or subjectAltName); empty lines and lines
    starting with # are skipped. ValueError (the server exits 2) when it names no one or a token
    twice."""
    tokens: dict[str, str] = {}
    certificates: set[str] = set()
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            parts = text.split()
            if len(parts) > 2:
                raise ValueError(f"{path}:{number}: expected 'TOKEN', 'NAME TOKEN' or '{CERTIFICATE_LINE} NAME', "
                                 f"got {len(parts)} words")
            if parts[0] == CERTIFICATE_LINE and len(parts) == 2:
                certificates.add(parts[1])
                continue
            token = parts[-1]
            name = parts[0] if len(parts) == 2 else f"token of line {number}"
            if token in tokens:
                raise ValueError(f"{path}:{number}: the same token is on line {tokens[token]}")
            tokens[token] = name
    if not tokens and not certificates:
        raise ValueError(f"--admin-token-file {path} holds no token and no {CERTIFICATE_LINE} line")
    return Admins(tokens, frozenset(certificates))


@dataclass(frozen=True)
class ClientCertificate:
    """A verified client certificate (mutual TLS): its names, and itself to check its issuer."""

    names: tuple[str, ...]
    """The subject's common names, then the subjectAltNames (DNS, URI, e-mail, IP)."""
    der: bytes = b""

    @classmethod
    def parse(cls, data: bytes, pem: bool) -> ClientCertificate:
        cert = x509.load_pem_x509_certificate(data) if pem else x509.load_der_x509_certificate(data)
        names = [str(a.value) for a in cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)]
        try:
            alternatives = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            names += [str(name.value) for name in alternatives]
        except x509.ExtensionNotFound:
            pass
        return cls(tuple(names), cert.public_bytes(Encoding.DER))

    def describe(self) -> str:
        return ", ".join(self.names) or "with no name"


def issued_by(certificate: ClientCertificate, authorities_pem: bytes) -> bool:
    """Whether one of the PEM certificates directly issued `certificate` (its name and signature)."""
    if not certificate.der or not authorities_pem:
        return False
    cert = x509.load_der_x509_certificate(certificate.der)
    for authority in x509.load_pem_x509_certificates(authorities_pem):
        try:
            cert.verify_directly_issued_by(authority)
            return True
        except (ValueError, TypeError, InvalidSignature):
            continue
    return False


def default_roots(sources: Iterable[ModelSource]) -> tuple[str, ...]:
    """The folders holding the start-up models (each base path's parent)."""
    return tuple(sorted({str(Path(s.base_path).resolve().parent) for s in sources}))


@dataclass(frozen=True)
class Caller:
    identity: str
    peer: str


class ControlPlane:
    def __init__(self, enabled: bool, tokens: Mapping[str, str], mutual_tls: bool, roots: Sequence[str],
                 certificates: frozenset[str] = frozenset(), admin_ca_pem: bytes = b"") -> None:
        self._enabled = enabled
        self._tokens = dict(tokens)
        self._mutual_tls = mutual_tls
        self._roots = tuple(os.path.realpath(r) for r in roots)
        self._certificates = certificates
        self._admin_ca_pem = admin_ca_pem

    @property
    def roots(self) -> tuple[str, ...]:
        return self._roots

    def with_roots(self, roots: Sequence[str]) -> ControlPlane:
        return ControlPlane(self._enabled, self._tokens, self._mutual_tls, roots, self._certificates,
                            self._admin_ca_pem)

    def authorize(self, method: str, peer: str, authorization: str | None,
                  certificate: ClientCertificate | None) -> Caller:
        """The caller, or PermissionDenied / Unauthenticated (logged). `authorization` is the
        header's value; `certificate` the verified client certificate, under mutual TLS."""
        if not self._enabled:
            self._log(method, peer, "-", "denied: model management is off")
            raise PermissionDenied(f"{method} changes the served models, which this server allows only when "
                                   f"started with --enable-model-management")
        if authorization is not None:
            token = authorization[len(BEARER):].strip() if authorization.lower().startswith(BEARER) else None
            name = self._token_name(token) if token else None
            if name is None:
                self._log(method, peer, "-", "denied: invalid token")
                raise Unauthenticated("the authorization header is not 'Bearer TOKEN' with a token of "
                                      "--admin-token-file")
            return Caller(name, peer)
        if self._mutual_tls and certificate is not None:
            identity = f"certificate {certificate.describe()}"
            if self._certificates.intersection(certificate.names) or issued_by(certificate, self._admin_ca_pem):
                return Caller(identity, peer)
            self._log(method, peer, identity, "denied: not an admin certificate")
            raise PermissionDenied(f"{method} changes the served models; the client certificate "
                                   f"({certificate.describe()}) is not an admin's: name it on a "
                                   f"'{CERTIFICATE_LINE} NAME' line of --admin-token-file, or issue it from "
                                   f"--admin-client-ca-file")
        self._log(method, peer, "-", "denied: no credential")
        raise Unauthenticated(f"{method} needs 'authorization: Bearer TOKEN' with a token of --admin-token-file"
                              + (", or a client certificate" if self._mutual_tls else ""))

    def _token_name(self, token: str) -> str | None:
        """The token's name; every known token is compared, in constant time, whatever matches."""
        found = None
        given = token.encode()
        for known, name in self._tokens.items():
            if hmac.compare_digest(given, known.encode()):
                found = name
        return found

    def check_paths(self, sources: Sequence[ModelSource]) -> None:
        """INVALID_ARGUMENT unless every base path resolves inside a model root. Only the resolved
        path is compared, before anything is read, so the answer is the same whether the path
        exists or not."""
        for source in sources:
            real = os.path.realpath(source.base_path)
            if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in self._roots):
                raise InvalidInput(f"model '{source.name}': base path {source.base_path} is not inside a model "
                                   f"root (--model-root: {', '.join(self._roots) or 'none'})")

    def done(self, caller: Caller, method: str, outcome: str) -> None:
        self._log(method, caller.peer, caller.identity, outcome)

    @staticmethod
    def _log(method: str, peer: str, identity: str, outcome: str) -> None:
        level = logging.INFO if outcome.startswith(("OK", "applied")) else logging.WARNING
        log.log(level, "model management %s from %s by %s: %s", method, peer or "an unknown peer", identity, outcome,
                extra={"peer": peer, "identity": identity, "method": method})


def grpc_credentials(metadata: Iterable[tuple[str, str | bytes]] | None,
                     auth_context: Mapping[str, Sequence[bytes]] | None) -> tuple[str | None, ClientCertificate | None]:
    """(authorization header, verified client certificate) of a gRPC call."""
    authorization = None
    for key, value in metadata or ():
        if key.lower() == "authorization":
            authorization = value.decode(errors="replace") if isinstance(value, bytes) else value
    certificate = None
    if auth_context:
        pem = auth_context.get("x509_pem_cert") or []
        if pem:
            certificate = ClientCertificate.parse(pem[0], pem=True)
        else:  # no certificate itself: its names only, which the token file may still list
            names = auth_context.get("x509_common_name") or auth_context.get("x509_subject") or []
            if names:
                certificate = ClientCertificate(tuple(n.decode(errors="replace") for n in names))
    return authorization, certificate


def rest_credentials(authorization: str | None, transport: Any) -> tuple[str | None, ClientCertificate | None]:
    """(authorization header, verified client certificate) of an HTTP request over `transport`
    (asyncio's): the certificate only under mutual TLS, where the handshake verified it."""
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    return authorization, ClientCertificate.parse(der, pem=False) if der else None
