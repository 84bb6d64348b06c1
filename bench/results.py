"""What a benchmark run measured, typed: bench.run fills these, bench.judge and bench.report read
them, and results.json holds them (`to_json`), in the shape the earlier dicts had."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from bench.perf import PerfRun
from client.bench import BenchResult

SERVERS = {"fixed": "fixed-response", "off": "batching off", "default": "default", "reference": "reference"}
"""The servers measured side by side, in turn order, with the names the tables give them."""
SWEPT = ("off", "default", "reference")
"""The servers of the open-loop sweep."""
PROTOCOLS = {"v2": "v2", "rest": "REST"}
"""The default server's other front-ends (--protocol of client bench), measured on --protocol-models."""


@dataclass(frozen=True)
class Run(BenchResult):
    """One `client bench` measurement, with what the suite adds to it."""

    rows_per_batch: float | None = None
    """Rows per executed batch over the run, from our servers' /metrics (None for the others)."""
    repeats_req_per_s: tuple[float, ...] = ()
    """A closed-loop point's every repeat's req/s (this run is the median one)."""

    def to_json(self) -> dict[str, Any]:
        found = dataclasses.asdict(self)
        if self.rows_per_batch is None:
            del found["rows_per_batch"]
        if not self.repeats_req_per_s:
            del found["repeats_req_per_s"]
        else:
            found["repeats_req_per_s"] = list(self.repeats_req_per_s)
        return found

    @property
    def all_server_cpu(self) -> float:
        """CPU per request of the server process and its children (the model worker), in µs."""
        return float((self.server_cpu_us or 0.0) + (self.server_children_cpu_us or 0.0))

    def unanswered(self) -> tuple[int, int]:
        """(requests without an OK answer, requests in all) of an open-loop run: those failed in the
        window, and those offered in it (scheduled) that were still unanswered at its end."""
        total = max(self.requests, self.offered or 0)
        return total - self.codes.get("OK", 0), total

    def latency_ms(self, key: str) -> float:
        """An open-loop run's p50_ms or p99_ms, a request without an OK answer counting as
        infinitely slow: inf when those reach that quantile."""
        quantile = {"p50_ms": 0.5, "p99_ms": 0.99}[key]
        missing, total = self.unanswered()
        if missing >= total or missing > (1 - quantile) * total:
            return math.inf
        return float(getattr(self, key))


def median_run(repeats: list[Run]) -> Run:
    """The repeat whose req/s is the median (its latencies with it), with every repeat's req/s."""
    if any(r.codes != {"OK": r.requests} or not r.requests for r in repeats):
        raise RuntimeError(f"a benchmark run had failures or no answers: {repeats}")
    ordered = sorted(repeats, key=lambda r: r.req_per_s)
    return dataclasses.replace(ordered[len(ordered) // 2], repeats_req_per_s=tuple(r.req_per_s for r in repeats))


def at_level(runs: list[Run], clients: int) -> Run | None:
    return next((r for r in runs if r.concurrency == clients), None)


@dataclass(frozen=True)
class SweepSide:
    """Every round of one server at one open-loop rate, and their p50/p99 (None: failures reached it)."""

    rate: float
    runs: list[Run]
    p50_ms: list[float | None]
    p99_ms: list[float | None]
    p50_ms_median: float | None
    p99_ms_median: float | None

    @classmethod
    def of(cls, repeats: list[Run]) -> SweepSide:
        figures: dict[str, Any] = {}
        for key in ("p50_ms", "p99_ms"):
            rounds = [r.latency_ms(key) for r in repeats]
            figures[key] = [None if math.isinf(v) else v for v in rounds]
            median = statistics.median(rounds)
            figures[f"{key}_median"] = None if math.isinf(median) else median
        return cls(rate=repeats[0].rate, runs=repeats, **figures)

    def values(self, key: str) -> list[float]:
        return [math.inf if v is None else float(v) for v in getattr(self, key)]

    def median(self, key: str) -> float:
        value = getattr(self, f"{key}_median")
        return math.inf if value is None else float(value)

    def no_worse_than(self, other: SweepSide, key: str) -> bool:
        """The sweep's noise rule: this side's median is no worse than the other's worst round."""
        return self.median(key) <= max(other.values(key))

    def to_json(self) -> dict[str, Any]:
        return {"rate": self.rate, "runs": [r.to_json() for r in self.runs], "p50_ms": self.p50_ms,
                "p99_ms": self.p99_ms, "p50_ms_median": self.p50_ms_median, "p99_ms_median": self.p99_ms_median}


@dataclass(frozen=True)
class SweepPoint:
    fraction: float
    rate: float
    sides: dict[str, SweepSide]
    """By server (SWEPT)."""

    def to_json(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "rate": self.rate, **{k: v.to_json() for k, v in self.sides.items()}}


@dataclass
class ModelResults:
    """One model's figures: the in-process ceiling, the closed-loop runs by server (SERVERS, and
    PROTOCOLS where measured), and the open-loop sweep."""

    closed: dict[str, list[Run]]
    inprocess: dict[str, float] = field(default_factory=dict)
    inprocess_runs: list[dict[str, float]] = field(default_factory=list)
    inprocess_cpu_us_per_row: dict[str, float] | None = None
    inprocess_1_row_ms: float = math.nan
    inprocess_1_row_ms_runs: list[float] = field(default_factory=list)
    capacity_clients: int = 0
    capacity_req_per_s: float = 0.0
    sweep: list[SweepPoint] = field(default_factory=list)
    perf: dict[str, list[PerfRun]] = field(default_factory=dict)
    """perf_analyzer's figures by server (SERVERS, and bench.perf.TRITON), one per concurrency."""

    def to_json(self) -> dict[str, Any]:
        return {"inprocess": self.inprocess, "inprocess_runs": self.inprocess_runs,
                "inprocess_cpu_us_per_row": self.inprocess_cpu_us_per_row,
                "inprocess_1_row_ms": self.inprocess_1_row_ms, "inprocess_1_row_ms_runs": self.inprocess_1_row_ms_runs,
                **{label: [r.to_json() for r in runs] for label, runs in self.closed.items()},
                "capacity_clients": self.capacity_clients, "capacity_req_per_s": self.capacity_req_per_s,
                "sweep": [p.to_json() for p in self.sweep],
                "perf_analyzer": {label: [r.to_json() for r in runs] for label, runs in self.perf.items()}}
