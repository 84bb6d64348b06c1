"""The log of refusals: requests the server turned away to protect itself (too many at once, a
message or body too large, a tensor that would decode past the limit, a body in an encoding it
does not decode, a malformed HTTP request).

Each refusal is counted (mirrorserve_requests_total, with its code, by whoever refuses it) and
logged here, but a flood must not flood the log too: the first refusal of a kind is logged at
once, with its peer, and later ones of that kind at most once every `interval_s`, saying how many
there were in between.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from server import metrics
from server.errors import Overloaded, ServingError, TooLargeInput, UnsupportedEncoding

log = logging.getLogger("server.refusals")

SUMMARY_S = 10.0
REFUSALS: tuple[type[ServingError], ...] = (Overloaded, TooLargeInput, UnsupportedEncoding)
"""The errors that are refusals (TooLarge is an Overloaded)."""


@dataclass
class _Kind:
    logged_at: float
    unlogged: int = 0


class RefusalLog:
    def __init__(self, interval_s: float = SUMMARY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._kinds: dict[str, _Kind] = {}

    def refused(self, kind: str, message: str, peer: str) -> bool:
        """Note one refusal; True when it was logged (else it is in the next line's count)."""
        now = self._clock()
        state = self._kinds.get(kind)
        if state is not None and now - state.logged_at < self._interval_s:
            state.unlogged += 1
            return False
        since = f" ({state.unlogged} more since the last such line)" if state is not None and state.unlogged else ""
        log.warning("refused %s from %s: %s%s", kind, peer or "an unknown peer", message, since,
                    extra={"refusal": kind, "peer": peer})
        self._kinds[kind] = _Kind(now)
        return True


REFUSAL_LOG = RefusalLog()
"""The server's one refusal log (every front-end notes its refusals here)."""


def is_refusal(exc: BaseException) -> bool:
    return isinstance(exc, REFUSALS)


def count_refusal(protocol: str, method: str, code: grpc.StatusCode, message: str, peer: str) -> None:
    """Count and log a refusal made before any handler ran (so under model="", version="")."""
    metrics.REQUESTS.labels(protocol, "", "", method, code.name).inc()
    REFUSAL_LOG.refused(f"{protocol} {method or 'request'} ({code.name})", message, peer)
