"""What a drain needs from every inference front-end: how many calls reached a handler and how
many left it, and a switch that makes new ones fail fast."""

from __future__ import annotations


class Admission:
    """`accepted` and `answered` count inference calls that reached the handler and that left it,
    so a drain can tell that nothing accepted was lost. After `refuse_new()` every new call is
    answered UNAVAILABLE at once and is not counted as accepted."""

    def __init__(self) -> None:
        self.accepted = 0
        self.answered = 0
        self._refusing = False

    @property
    def in_flight(self) -> int:
        return self.accepted - self.answered

    def refuse_new(self) -> None:
        self._refusing = True
