"""What every inference front-end does the same way around a call: counting the calls that
reached a handler and left it (for the drain), refusing new ones once a drain refuses, and the
client's deadline on the server's clock."""

from __future__ import annotations

import time

import grpc

from server.api.recording import Recorder

REFUSED = "the server is shutting down; retry on another replica"


class Admission:
    """`accepted` and `answered` count inference calls that reached the handler and that left it,
    so a drain can tell that nothing accepted was lost. After `refuse_new()` every new call is
    answered UNAVAILABLE at once and is not counted as accepted."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self.accepted = 0
        self.answered = 0
        self._refusing = False

    @property
    def in_flight(self) -> int:
        return self.accepted - self.answered

    def refuse_new(self) -> None:
        self._refusing = True

    @property
    def refusing(self) -> bool:
        return self._refusing

    def refused(self, method: str, started: float) -> str:
        """Record a call refused because the server is draining (UNAVAILABLE); the message to send."""
        self._recorder.record(method, grpc.StatusCode.UNAVAILABLE, started)
        return REFUSED

    async def refuse(self, method: str, context: grpc.aio.ServicerContext, started: float) -> None:
        """Answer UNAVAILABLE (counted) because the server is draining; raises, as abort does."""
        await context.abort(grpc.StatusCode.UNAVAILABLE, self.refused(method, started))


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The client's deadline on time.monotonic's clock, or None without one."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining
