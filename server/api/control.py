"""Who may change what the server runs, and where models may come from.

A SavedModel is code: its signatures can read and write files with the server's rights. So a
call that loads or removes models (TF Serving's HandleReloadConfigRequest; Triton's repository
calls later) is refused unless all three hold:

1. the server was started with --enable-model-management (else PERMISSION_DENIED, naming it);
2. the call carries `authorization: Bearer TOKEN` with a token of --admin-token-file, compared in
   constant time, or comes over mutual TLS with a client certificate (else UNAUTHENTICATED);
3. every base path it names resolves, symlinks followed, inside a --model-root (by default the
   folders holding the start-up models); else INVALID_ARGUMENT, checked before the path is looked
   at, so the answer does not tell whether it exists.

Every such call is logged with its peer, who it was (the token's name, never the token; or the
certificate's subject) and its outcome. TF Serving leaves its ModelService open to anyone who
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

from server.core.model_config import ModelSource
from server.errors import InvalidInput, PermissionDenied, Unauthenticated

log = logging.getLogger("server.control")

BEARER = "bearer "


def read_tokens(path: str) -> dict[str, str]:
    """token -> the name logged for it, from a token file: one token per line, or 'NAME TOKEN';
    empty lines and lines starting with # are skipped. ValueError (the server exits 2) when it
    holds no token or a token twice."""
    tokens: dict[str, str] = {}
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            parts = text.split()
            if len(parts) > 2:
                raise ValueError(f"{path}:{number}: expected 'TOKEN' or 'NAME TOKEN', got {len(parts)} words")
            token = parts[-1]
            name = parts[0] if len(parts) == 2 else f"token of line {number}"
            if token in tokens:
                raise ValueError(f"{path}:{number}: the same token is on line {tokens[token]}")
            tokens[token] = name
    if not tokens:
        raise ValueError(f"--admin-token-file {path} holds no token")
    return tokens


def default_roots(sources: Iterable[ModelSource]) -> tuple[str, ...]:
    """The folders holding the start-up models (each base path's parent)."""
    return tuple(sorted({str(Path(s.base_path).resolve().parent) for s in sources}))


@dataclass(frozen=True)
class Caller:
    identity: str
    peer: str


class ControlPlane:
    def __init__(self, enabled: bool, tokens: Mapping[str, str], mutual_tls: bool, roots: Sequence[str]) -> None:
        self._enabled = enabled
        self._tokens = dict(tokens)
        self._mutual_tls = mutual_tls
        self._roots = tuple(os.path.realpath(r) for r in roots)

    @property
    def roots(self) -> tuple[str, ...]:
        return self._roots

    def with_roots(self, roots: Sequence[str]) -> ControlPlane:
        return ControlPlane(self._enabled, self._tokens, self._mutual_tls, roots)

    def authorize(self, method: str, peer: str, authorization: str | None, certificate: str | None) -> Caller:
        """The caller, or PermissionDenied / Unauthenticated (logged). `authorization` is the
        header's value; `certificate` the verified client certificate's subject, under mutual TLS."""
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
        if self._mutual_tls and certificate:
            return Caller(f"certificate {certificate}", peer)
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
                     auth_context: Mapping[str, Sequence[bytes]] | None) -> tuple[str | None, str | None]:
    """(authorization header, client certificate subject) of a gRPC call."""
    authorization = None
    for key, value in metadata or ():
        if key.lower() == "authorization":
            authorization = value.decode(errors="replace") if isinstance(value, bytes) else value
    subject = None
    if auth_context:
        names = auth_context.get("x509_common_name") or auth_context.get("x509_subject") or []
        subject = ", ".join(n.decode(errors="replace") for n in names) or None
    return authorization, subject


def rest_credentials(authorization: str | None, peercert: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    """(authorization header, client certificate subject) of an HTTPS request; `peercert` is
    ssl's getpeercert() of a verified client certificate (mutual TLS), else None."""
    subject = None
    if peercert:
        names = [value for rdn in peercert.get("subject", ()) for key, value in rdn if key == "commonName"]
        subject = ", ".join(names) or None
    return authorization, subject
