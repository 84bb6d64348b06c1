"""CPU seconds used by processes, for the load generator's CPU-per-request figures.

On a machine that the load generator shares with the server, throughput is decided by where each
request's CPU goes: the generator's own share and the server's (its model worker included). The
figures come from Linux's /proc: a process's utime + stime counts all its threads, and a server's
children (the model worker) are found through /proc/PID/task/TID/children.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process (all its threads); None if it is gone."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may contain spaces
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def descendants(pid: int) -> list[int]:
    """pid and every process below it."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            tasks = list((PROC / str(current) / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                todo += [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                continue
    return found


def tree_cpu_by_pid(pids: Iterable[int]) -> tuple[dict[int, float], dict[int, float]]:
    """CPU seconds of each given process and of each of their descendants, live ones only."""
    pids = list(pids)
    below = {p for pid in pids for p in descendants(pid)} - set(pids)

    def live(group: Iterable[int]) -> dict[int, float]:
        return {pid: cpu for pid in group if (cpu := process_cpu_seconds(pid)) is not None}

    return live(pids), live(below)


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float | None:
    """CPU used between two per-process samples; None if a process of the first has ended since:
    its last seconds are lost with it, and a difference would understate, even below zero."""
    if not before.keys() <= after.keys():
        return None
    return sum(after.values()) - sum(before.values())


class CpuWindow:
    """CPU used between `begin()` and `end()`: by this process, by the watched processes, and by
    their descendants. A server and its model worker are kept apart because each Python process
    runs its Python code one thread at a time: a server process that uses about one core is
    saturated, whatever its children do. A figure is None when a process it covers ended within
    the window (a server killed mid-run), rather than a difference that makes no sense."""

    def __init__(self, watched: Iterable[int] = ()) -> None:
        self.watched = list(watched)
        self._begin: tuple[float, dict[int, float], dict[int, float]] | None = None
        self.own_s: float | None = None
        self.watched_s: float | None = None
        self.children_s: float | None = None

    def _now(self) -> tuple[float, dict[int, float], dict[int, float]]:
        return (time.process_time(), *tree_cpu_by_pid(self.watched))

    def begin(self) -> None:
        self._begin = self._now()

    def end(self) -> None:
        if self._begin is None:
            return
        own, watched, children = self._now()
        self.own_s = own - self._begin[0]
        if self.watched:
            self.watched_s = cpu_used(self._begin[1], watched)
            self.children_s = cpu_used(self._begin[2], children)
