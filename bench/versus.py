"""Two servers side by side, on one model: this build against another revision of it, or this
build with other flags. The closed-loop bench client measures each in turns, in one run, so a
change's cost is measured against the build (or setting) without it seconds apart, not in runs
minutes or days apart on a machine whose speed drifts.

Another revision is checked out once into build/versus/REV (a git worktree) and its server is
started from there with the same Python environment. Both serve the same bench model, with
`--server-flags`, the other side with `--other-flags` instead where given. Each turn measures A
then B, or B then A (alternating, so neither always goes first), `--repeat` times at each
concurrency; the table gives each side's median p50, p99 and req/s over its repeats and the ratio
of the medians.

usage: python -m bench.versus [REV] [--model mlp] [--concurrency 1] [--server-flags FLAGS]
       [--other-flags FLAGS] [--repeat 7] [--seconds 3] [--warmup-s 1] [--out DIR]
       (no REV: this build on both sides, so --other-flags is what differs)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.launch import ROOT, ServerProcess, spawn_server, wait_for_server
from bench.results import Run
from bench.run import SHAPES, build_models, measure


def checkout(rev: str, out: Path) -> Path:
    """A worktree of `rev` under `out` (made once; reused while it is at that revision)."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    tree = out / commit[:12]
    if not (tree / "server" / "__main__.py").is_file():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--force", "--detach", str(tree), commit], cwd=ROOT, check=True,
                       capture_output=True)
    return tree


def start(tree: Path, base: Path, flags: list[str], log: Path) -> ServerProcess:
    args = ["--model-base-path", str(base), "--model-name", base.name, "--drain-delay-s", "0", *flags]
    return wait_for_server(spawn_server(args, log, tree=tree), log, timeout=240)


def rows(level: int, runs: dict[str, list[Run]]) -> list[str]:
    """The table's rows at one concurrency: each side's medians over its repeats, then the ratio."""
    found, p50 = [], {}
    for label, repeats in runs.items():
        p50[label] = statistics.median(r.p50_ms for r in repeats)
        p99 = statistics.median(r.p99_ms for r in repeats)
        rate = statistics.median(r.req_per_s for r in repeats)
        each = ", ".join(f"{r.p50_ms:.3f}" for r in repeats)
        found.append(f"| {level} | {label} | {p50[label]:.3f} | {p99:.3f} | {rate:,.0f} | p50s {each} |")
    (this, a), (that, b) = p50.items()
    return [*found, f"| {level} | {this} / {that} | {a / b:.3f} | | | |"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", nargs="?", default="",
                        help="the other revision (a commit, tag or branch of this repository); none: this build")
    parser.add_argument("--model", default="mlp", choices=sorted(SHAPES))
    parser.add_argument("--concurrency", default="1", help="closed-loop client counts (comma-separated)")
    parser.add_argument("--server-flags", default="", help="flags for both servers")
    parser.add_argument("--other-flags", default=None, help="flags for the other side instead")
    parser.add_argument("--repeat", type=int, default=7, help="turns per concurrency")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured window per run")
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "versus")
    opts = parser.parse_args(argv)
    if not opts.rev and opts.other_flags is None:
        parser.error("give a REV, --other-flags, or both: the two sides must differ")
    other = checkout(opts.rev, opts.out) if opts.rev else ROOT
    base = build_models([opts.model], opts.out / "models")[opts.model]
    flags = shlex.split(opts.server_flags)
    other_flags = flags if opts.other_flags is None else shlex.split(opts.other_flags)
    label = " ".join(filter(None, [opts.rev or "this build", opts.other_flags]))
    sides = {f"this build {opts.server_flags}".strip(): (ROOT, flags), label: (other, other_flags)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        row = work / "row.npy"
        np.save(row, np.random.default_rng(0).standard_normal(SHAPES[opts.model][1]).astype(np.float32))
        servers = {label: start(tree, base, side_flags, work / f"server-{i}.log")
                   for i, (label, (tree, side_flags)) in enumerate(sides.items())}
        try:
            where = "; ".join(f"{label}: {tree} {' '.join(side_flags)}" for label, (tree, side_flags) in sides.items())
            print(f"# {opts.model}: {where}")
            print("| callers | side | p50 ms | p99 ms | req/s | runs |\n|---|---|---|---|---|---|")
            for level in (int(c) for c in opts.concurrency.split(",")):
                runs: dict[str, list[Run]] = {label: [] for label in sides}
                for turn in range(opts.repeat):
                    order = list(sides) if turn % 2 == 0 else list(reversed(sides))
                    for label in order:
                        server = servers[label]
                        with contextlib.redirect_stdout(io.StringIO()):  # the client's own table: one table here
                            run = measure(f"127.0.0.1:{server.port},{server.rest_port}", opts.model, row, opts,
                                          ["--concurrency", str(level)], server.process.pid)
                        if run.codes != {"OK": run.requests}:
                            raise RuntimeError(f"{label}: failures {run.codes}")
                        runs[label].append(run)
                print("\n".join(rows(level, runs)), flush=True)
        finally:
            for server in servers.values():
                server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
