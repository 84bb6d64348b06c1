"""The judging half of `make bench` (bench.suite): the goals, each PASS or FAIL from a run's own
figures (bench.results), and what this machine allowed any server (goal a's reach)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from bench.results import SERVERS, ModelResults, at_level

GOAL_LEVEL = 64
"""The clients at which goals a and d are judged, and the sweep's capacity is measured."""
GOAL_THROUGHPUT = 1.15
GOAL_LATENCY_MODELS = ("mlp", "cnn")
GOAL_LATENCY = 1.3
GOAL_CPU_MODEL = "mlp"
GOAL_CPU = 1.5


def ms(value: float) -> str:
    return "failed" if math.isinf(value) else f"{value:.2f}"


@dataclass
class Goal:
    key: str
    text: str
    status: str = "NOT MEASURED"
    """PASS, FAIL, or NOT MEASURED (the run did not include what it needs)."""
    summary: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    def judge(self, checks: list[bool]) -> None:
        if checks:
            self.status = "PASS" if all(checks) else "FAIL"


def finite(value: float) -> float | None:
    """A figure for results.json: None for inf (a failed request's latency) and NaN."""
    return value if math.isfinite(value) else None


def machine_reach(r: ModelResults) -> dict[str, float] | None:
    """The most req/s at GOAL_LEVEL clients that this run's own figures allow any gRPC server on this
    machine, by two limits, the lower counting: the fixed-response server's req/s (a grpc.aio server
    that does no work answered no faster), and the machine's cores over the least CPU a request can
    cost: the model's own per row at its cheapest batch size in-process, plus the fixed-response
    server's per request, plus the least the load generator spent per request on any of the servers.
    Over the reference's req/s, it is the most goal a's ratio could be here, as far as the run can
    tell. None where the run lacks a figure."""
    per_row = r.inprocess_cpu_us_per_row
    fixed = at_level(r.closed["fixed"], GOAL_LEVEL)
    runs = [at_level(r.closed[label], GOAL_LEVEL) for label in SERVERS]
    if not per_row or fixed is None or any(run is None for run in runs):
        return None
    model_us = min(per_row.values())
    client_us = min(run.client_cpu_us or 0.0 for run in runs if run is not None)
    least_us = model_us + (fixed.server_cpu_us or 0.0) + client_us
    cores = len(os.sched_getaffinity(0))
    return {"reach_req_per_s": min(fixed.req_per_s, cores * 1e6 / least_us), "cores": cores,
            "least_cpu_us": least_us, "model_cpu_us_per_row": model_us}


def goals(results: dict[str, ModelResults]) -> list[Goal]:
    """The goals, judged on every model of the run that each needs."""
    a = Goal("a", f"at {GOAL_LEVEL} clients, on every model: default req/s / reference req/s >= {GOAL_THROUGHPUT}")
    b = Goal("b", "at every sweep load, on every model: default's p50 and p99 no worse than batching off's and "
                  "than the reference's (default's median <= the other's worst round)")
    c = Goal("c", f"at 1 client, on {' and '.join(GOAL_LATENCY_MODELS)}: default p50 <= {GOAL_LATENCY} x "
                  "(fixed-response p50 + in-process 1-row call)")
    d = Goal("d", f"at {GOAL_LEVEL} {GOAL_CPU_MODEL} clients: CPU per request of all the default server's "
                  f"processes <= {GOAL_CPU} x the fixed-response server's")
    checks: dict[str, list[bool]] = {"a": [], "b": [], "c": [], "d": []}
    notes: dict[str, list[str]] = {"a": [], "c": [], "d": []}
    worse: list[str] = []
    for model, r in results.items():
        default, reference = at_level(r.closed["default"], GOAL_LEVEL), at_level(r.closed["reference"], GOAL_LEVEL)
        if default and reference:
            value = default.req_per_s / reference.req_per_s
            a.figures[model] = {"ratio": value}
            checks["a"].append(value >= GOAL_THROUGHPUT)
            notes["a"].append(f"{model} {value:.2f}")
            reach = machine_reach(r)
            if reach is not None:
                reach_ratio = reach["reach_req_per_s"] / reference.req_per_s
                a.figures[model].update(reach, reach_ratio=reach_ratio)
                notes["a"][-1] += f" (reach {reach_ratio:.2f})"
        for point in r.sweep:
            for other in ("off", "reference"):
                for key in ("p50_ms", "p99_ms"):
                    ours, theirs = point.sides["default"], point.sides[other]
                    ok = ours.no_worse_than(theirs, key)
                    checks["b"].append(ok)
                    where = f"{model} {point.fraction:.0%} {key[:3]} vs {SERVERS[other]}"
                    others_worst = max(theirs.values(key))
                    b.figures[where] = {"default_median_ms": finite(ours.median(key)),
                                        "other_worst_ms": finite(others_worst),
                                        "ratio_of_medians": finite(ours.median(key) / theirs.median(key)),
                                        "pass": ok}
                    if not ok:
                        worse.append(f"{where}: {ms(ours.median(key))} > {ms(others_worst)} ms")
        fixed_1, default_1 = at_level(r.closed["fixed"], 1), at_level(r.closed["default"], 1)
        if model in GOAL_LATENCY_MODELS and fixed_1 and default_1:
            bound = GOAL_LATENCY * (fixed_1.p50_ms + r.inprocess_1_row_ms)
            c.figures[model] = {"default_p50_ms": default_1.p50_ms, "fixed_p50_ms": fixed_1.p50_ms,
                                "inprocess_1_row_ms": r.inprocess_1_row_ms, "bound_ms": bound}
            checks["c"].append(default_1.p50_ms <= bound)
            notes["c"].append(f"{model} {default_1.p50_ms:.2f} ms vs {GOAL_LATENCY} x ({fixed_1.p50_ms:.2f} "
                              f"+ {r.inprocess_1_row_ms:.2f}) = {bound:.2f} ms")
        fixed_64 = at_level(r.closed["fixed"], GOAL_LEVEL)
        if model == GOAL_CPU_MODEL and default and fixed_64 and fixed_64.all_server_cpu > 0:
            ours_cpu, fixed_cpu = default.all_server_cpu, fixed_64.all_server_cpu
            d.figures[model] = {"default_cpu_us": ours_cpu, "fixed_cpu_us": fixed_cpu,
                                "ratio": ours_cpu / fixed_cpu}
            checks["d"].append(ours_cpu <= GOAL_CPU * fixed_cpu)
            notes["d"].append(f"{model} {ours_cpu:,.0f} / {fixed_cpu:,.0f} µs = {ours_cpu / fixed_cpu:.2f}")
    for goal in (a, c, d):
        goal.summary = ", ".join(notes[goal.key])
    if checks["b"]:
        b.summary = f"{sum(checks['b'])} of {len(checks['b'])} comparisons pass"
        if worse:
            b.summary += "; worse than the other's worst round: " + "; ".join(worse)
    for goal in (a, b, c, d):
        goal.judge(checks[goal.key])
    return [a, b, c, d]
