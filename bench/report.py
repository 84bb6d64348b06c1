"""The report half of `make bench` (bench.suite): build/bench/results.md from a run's typed
figures (bench.results) and its judged goals (bench.judge)."""

from __future__ import annotations

import argparse
import math
import os
import time

from bench.judge import GOAL_CPU, GOAL_CPU_MODEL, GOAL_LEVEL, Goal, ms
from bench.perf import SERVER_COLUMNS, TRITON
from bench.results import PROTOCOLS, SERVERS, SWEPT, ModelResults, Run, SweepSide


def rate(run: Run) -> str:
    """req/s of the median run, with the range over the repeats."""
    repeats = run.repeats_req_per_s
    spread = f" ({min(repeats):,.0f}-{max(repeats):,.0f})" if len(repeats) > 1 else ""
    return f"{run.req_per_s:,.0f}{spread}"


def cpu(run: Run, key: str) -> str:
    value = getattr(run, key)
    return "-" if value is None else f"{value:,.0f}"


def server_cpu(run: Run) -> str:
    """The server process's CPU per request, and in brackets the cores that came to."""
    value = run.server_cpu_us
    return "-" if value is None else f"{value:,.0f} ({value * run.requests / run.seconds / 1e6:.2f})"


def per_batch(run: Run) -> str:
    value = run.rows_per_batch
    return "-" if value is None else f"{value:.1f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b and math.isfinite(a) and math.isfinite(b) else "n/a"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def goals_section(found: list[Goal]) -> list[str]:
    lines = ["## Goals", "",
             "Each computed from this run. Sweep noise rule (goal b): a point passes when the default server's "
             "median over the rounds is no worse than the other server's worst round; a request without an OK "
             "answer (failed, or offered in the window and still unanswered at its end) counts as infinitely slow. "
             "Reach (goal a): the most any gRPC server could have answered on this machine by this run's own "
             "figures, over the reference's req/s: the lower of the fixed-response server's req/s and the cores "
             "over the least CPU a request needs (the model's in-process CPU per row at its cheapest batch size, the "
             "fixed-response server's CPU per request, the load generator's least CPU per request).",
             ""]
    for goal in found:
        lines.append(f"- {goal.key}) {goal.text}: **{goal.status}**" + (f" — {goal.summary}" if goal.summary else ""))
    return [*lines, ""]


def model_cpu(r: ModelResults) -> str:
    """The in-process CPU per row at each batch size (the lower of the two measurements), if the run has it."""
    per_row = r.inprocess_cpu_us_per_row
    if not per_row:
        return ""
    return "; CPU per row, every thread of the process, the lower of the two: " + ", ".join(
        f"batch {b}: {us:,.0f} µs" for b, us in per_row.items())


def _side_by_side(r: ModelResults) -> zip[tuple[Run, Run, Run, Run]]:
    """The four servers' runs at each client count."""
    return zip(*(r.closed[label] for label in SERVERS), strict=True)


def closed_loop_section(r: ModelResults) -> list[str]:
    ceiling = r.inprocess
    before, after = r.inprocess_runs
    one_before, one_after = r.inprocess_1_row_ms_runs
    best_ceiling = ceiling.get("64") or max(ceiling.values())
    lines = ["In-process ceiling (SavedModel called directly; before the servers / after them; the ratios use "
             "the better): " + ", ".join(f"batch {b}: {before[b]:,.0f} / {after[b]:,.0f} rows/s" for b in ceiling)
             + f"; one 1-row call: {one_before:.2f} / {one_after:.2f} ms" + model_cpu(r)
             + ". Rows per batch: the default server's average over the median run, its warm-up included.", ""]
    lines += table(
        ["clients", "fixed-response gRPC req/s", "batching off req/s", "default req/s", "reference req/s",
         "default / fixed", "default / off", "default / reference", "default / in-process@64", "p50 ms off",
         "p50 ms default", "p50 ms reference", "p99 ms default", "p99 ms reference", "default rows per batch"],
        [[str(d.concurrency), rate(f), rate(o), rate(d), rate(ref), ratio(d.req_per_s, f.req_per_s),
          ratio(d.req_per_s, o.req_per_s), ratio(d.req_per_s, ref.req_per_s),
          ratio(d.rows_per_s, best_ceiling), f"{o.p50_ms:.2f}", f"{d.p50_ms:.2f}", f"{ref.p50_ms:.2f}",
          f"{d.p99_ms:.2f}", f"{ref.p99_ms:.2f}", per_batch(d)]
         for f, o, d, ref in _side_by_side(r)])
    lines += ["", "CPU per request in µs over the measured window of the median run; in brackets, the cores "
              "the server process itself used (its Python threads share one GIL, so about 1 means saturated):", ""]
    lines += table(
        ["clients", "fixed-response: load generator", "fixed-response: server", "batching off: load generator",
         "batching off: server", "batching off: model worker", "default: load generator", "default: server",
         "default: model worker", "reference: load generator", "reference: server"],
        [[str(d.concurrency), cpu(f, "client_cpu_us"), server_cpu(f), cpu(o, "client_cpu_us"), server_cpu(o),
          cpu(o, "server_children_cpu_us"), cpu(d, "client_cpu_us"), server_cpu(d),
          cpu(d, "server_children_cpu_us"), cpu(ref, "client_cpu_us"), server_cpu(ref)]
         for f, o, d, ref in _side_by_side(r)])
    lines += ["", f"CPU per request of all server processes together (the server and its model worker), µs (goal d, "
              f"on {GOAL_CPU_MODEL} at {GOAL_LEVEL} clients: default / fixed <= {GOAL_CPU}):", ""]
    lines += table(
        ["clients", "fixed-response", "batching off", "default", "reference", "default / fixed",
         "default / reference"],
        [[str(d.concurrency), f"{f.all_server_cpu:,.0f}", f"{o.all_server_cpu:,.0f}",
          f"{d.all_server_cpu:,.0f}", f"{ref.all_server_cpu:,.0f}", ratio(d.all_server_cpu, f.all_server_cpu),
          ratio(d.all_server_cpu, ref.all_server_cpu)]
         for f, o, d, ref in _side_by_side(r)])
    return lines


def perf_section(r: ModelResults, levels: list[int]) -> list[str]:
    """perf_analyzer's table (bench.perf): req/s and p50 per server and concurrency, and this
    server's own split of a request's time as its statistics report it."""
    if not r.perf:
        return []
    labels = [*SERVERS, TRITON]
    names = {**SERVERS, TRITON: "default (Triton kind, gRPC)"}
    lines = ["", "perf_analyzer (Triton's C++ client; the same servers, models and concurrencies; TF Serving's "
             "Predict unless said; the average of its last three windows): req/s, and p50 ms in brackets:", ""]
    lines += table(["clients", *(names[label] for label in labels), "default / fixed", "default / reference"],
                   [[str(level), *(f"{r.perf[label][i].req_per_s:,.0f} ({r.perf[label][i].p50_ms:.2f})"
                                   for label in labels),
                     ratio(r.perf["default"][i].req_per_s, r.perf["fixed"][i].req_per_s),
                     ratio(r.perf["default"][i].req_per_s, r.perf["reference"][i].req_per_s)]
                    for i, level in enumerate(levels)])
    lines += ["", "perf_analyzer's own CPU per request, µs (estimated over its whole run), against the Python "
              "client's on the same server (TF Serving's Predict, the median run above):", ""]
    lines += table(["clients", *(f"{SERVERS[label]}: perf_analyzer / python" for label in SERVERS)],
                   [[str(level), *(f"{r.perf[label][i].client_cpu_us:,.0f} / {cpu(r.closed[label][i], 'client_cpu_us')}"
                                   for label in SERVERS)] for i, level in enumerate(levels)])
    split = [(level, run.server_us) for level, run in zip(levels, r.perf[TRITON], strict=True) if run.server_us]
    if split:
        lines += ["", "This server's split of a request, µs (perf_analyzer's Triton kind, from ModelStatistics):", ""]
        lines += table(["clients", "queue", "compute input", "compute infer", "compute output"],
                       [[str(level), *(f"{us[key]:,.0f}" for key in SERVER_COLUMNS)] for level, us in split])
    return lines


def protocol_section(r: ModelResults, label: str) -> list[str]:
    """The default server over another front-end (v2 or REST) against its Predict, in the same turns."""
    name = PROTOCOLS[label]
    intro = {"v2": "Open Inference Protocol (v2 ModelInfer, raw contents) against TF Serving's Predict (the goal: "
                   "v2 / Predict CPU <= 1.10)",
             "rest": "TF Serving's REST predict (JSON, row format, aiohttp client) against its gRPC Predict"}[label]
    lines = ["", f"{intro}: the same default server measured in the same turns; server CPU is per request, the "
             "server and its model worker together, and the load generator's own is beside it:", ""]
    return lines + table(
        ["clients", "Predict req/s", f"{name} req/s", f"{name} / Predict req/s", "Predict p50 ms", f"{name} p50 ms",
         "Predict server CPU µs", f"{name} server CPU µs", f"{name} / Predict CPU", f"{name} load generator CPU µs"],
        [[str(d.concurrency), rate(d), rate(p), ratio(p.req_per_s, d.req_per_s), f"{d.p50_ms:.2f}",
          f"{p.p50_ms:.2f}", f"{d.all_server_cpu:,.0f}", f"{p.all_server_cpu:,.0f}",
          ratio(p.all_server_cpu, d.all_server_cpu), cpu(p, "client_cpu_us")]
         for d, p in zip(r.closed["default"], r.closed[label], strict=True)])


def spread(side: SweepSide, key: str) -> str:
    """A sweep cell: the median over the rounds, and the range of the rounds."""
    rounds = side.values(key)
    text = ms(side.median(key))
    return text + (f" ({ms(min(rounds))}-{ms(max(rounds))})" if len(rounds) > 1 else "")


def without_answer(run: Run) -> str:
    """What an open-loop run left without an OK answer ("" if nothing): failures, and the requests
    offered in the window still unanswered at its end."""
    missing, total = run.unanswered()
    if not missing:
        return ""
    parts = [f"{code} {n}" for code, n in sorted(run.codes.items()) if code != "OK"]
    if total > run.requests:
        parts.append(f"{total - run.requests} unanswered at the window's end")
    return f"{missing} of {total} ({', '.join(parts)})"


def sweep_section(r: ModelResults, rounds: int) -> list[str]:
    if not r.sweep:
        return []
    lines = ["", f"Open loop: Poisson arrivals at fractions of capacity ({r.capacity_req_per_s:,.0f} req/s, the "
             f"default server's median at {r.capacity_clients} clients above), latency from each request's "
             f"scheduled start; each cell the median of {rounds} rounds (their range in brackets). A point passes "
             "when default's median is no worse than the other's worst round (goal b):", ""]
    rows = []
    notes: list[str] = []
    for point in r.sweep:
        off, default, reference = (point.sides[label] for label in ("off", "default", "reference"))
        passed = all(default.no_worse_than(other, key) for other in (off, reference) for key in ("p50_ms", "p99_ms"))
        rows.append([f"{point.fraction:.0%}", f"{point.rate:,.0f}",
                     *(spread(p, "p50_ms") for p in (off, default, reference)),
                     *(spread(p, "p99_ms") for p in (off, default, reference)),
                     f"{ratio(default.median('p50_ms'), off.median('p50_ms'))}, "
                     f"{ratio(default.median('p99_ms'), off.median('p99_ms'))}",
                     f"{ratio(default.median('p50_ms'), reference.median('p50_ms'))}, "
                     f"{ratio(default.median('p99_ms'), reference.median('p99_ms'))}",
                     "PASS" if passed else "FAIL"])
        for label in SWEPT:
            notes += [f"{point.fraction:.0%} {SERVERS[label]} round {i}: {note}"
                      for i, run in enumerate(point.sides[label].runs, 1) if (note := without_answer(run))]
    lines += table(["load", "rate req/s", "p50 ms off", "p50 ms default", "p50 ms reference", "p99 ms off",
                    "p99 ms default", "p99 ms reference", "default / off p50, p99", "default / reference p50, p99",
                    "pass"], rows)
    if notes:
        lines += ["", "Requests without an OK answer, counted as infinitely slow: " + "; ".join(notes)]
    return lines


def report(results: dict[str, ModelResults], found: list[Goal], opts: argparse.Namespace) -> str:
    lines = [f"# Benchmark ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, "
             f"{opts.seconds:g} s per point after {opts.warmup_s:g} s warm-up, median of {opts.repeat} runs "
             "taken in turns with the four servers side by side, one client process sending 1-row "
             "requests on the same machine)", "", *goals_section(found)]
    for model, r in results.items():
        lines += [f"## {model}", "", *closed_loop_section(r)]
        for label in PROTOCOLS:
            if label in r.closed:
                lines += protocol_section(r, label)
        lines += perf_section(r, [int(c) for c in opts.concurrency.split(",")])
        lines += [*sweep_section(r, opts.repeat), ""]
    return "\n".join(lines)
