"""`make gpu-check`: the replica path on a real GPU, in one run of about five minutes, printing one
table and exiting 1 if any check fails. Needs nothing but the repository (`make gpu-check`
installs the `gpu` extra and the official clients first).

1. devices: what nvidia-smi sees, and where the server put its two replicas. One GPU is split into
   two logical GPUs (the server does it for `--replicas 2` on one card), so that `strategy.run`
   has two GPU replicas.
2. answers: the server on those replicas; TF Serving's official client and tritonclient send
   requests of 1 to 300 rows, all at once; every answer must equal the model called in-process on
   its own rows (TF32 off on both sides, so the two differ only by summation order), and
   mirrorserve_replica_rows_total must show both replicas working.
3. throughput: req/s and p50 at 1, 16 and 64 callers on the bench's mlp and cnn, on the GPU and
   on the machine's CPU, each against its in-process ceiling at batch 64 (rows/s): the ratio
   server / in-process is the figure to report. Every call must be OK: at 1 caller each batch has
   one row, fewer than the replicas: it runs on one replica while the other idles.
4. memory: the GPU memory the server's model worker holds after each of 5 load/unload cycles of
   a model (TensorFlow's memory growth on, one replica), which must stay flat.
5. front-ends: req/s, p50 and CPU at --frontends 1, 2, 4 and 8 on the mlp (bench.frontends), on
   the machine's cores; reported, judged only by every call being answered.

Without a GPU it is a dry run, and says so in its first line: checks 2 and 3 on two logical CPU
devices, 1, 4 and 5 skipped. `--short` (what `make test` runs, dry) keeps each check small.

usage: python -m bench.gpu_check [--short] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.launch import ROOT, ServerProcess, start_server
from bench.run import SHAPES, build_models, measure, run_json, run_python

TOKEN = "gpu-check-token"
MEMORY_SLACK_MB = 64
"""How far the worker's GPU memory may rise from the first cycle to the last and still be flat."""


@dataclasses.dataclass
class Check:
    name: str
    passed: bool | None
    """None: skipped (no GPU)."""
    detail: str


@dataclasses.dataclass
class Plan:
    """What one run checks: the full run, or the short dry run of `make test`."""

    gpu: bool
    short: bool
    out: Path

    @property
    def sizes(self) -> list[int]:
        return [1, 5, 64, 65, 300] if self.short else [1, 2, 3, 7, 16, 31, 63, 64, 65, 100, 127, 128, 200, 255, 300]

    @property
    def models(self) -> list[str]:
        return ["mlp", "cnn"]

    def levels(self, model: str) -> list[int]:
        """Callers check 3 runs at. Short: the cnn at 1 caller alone, where every batch has fewer
        rows than replicas (each 1-row call failed there while a replica was given zero rows)."""
        if not self.short:
            return [1, 16, 64]
        return [1, 16] if model == "mlp" else [1]

    @property
    def seconds(self) -> float:
        return 0.5 if self.short else 4.0

    def devices(self) -> list[tuple[str, dict[str, str]]]:
        """(label, environment) of each device kind check 3 runs on."""
        cpu = ("CPU", {"CUDA_VISIBLE_DEVICES": ""})
        return [("GPU", {}), cpu] if self.gpu else [cpu]


def nvidia_smi(*query: str) -> list[str]:
    """nvidia-smi's CSV lines for a query, [] without nvidia-smi or a GPU."""
    try:
        done = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def serve(plan: Plan, base: Path, name: str, env: dict[str, str], *flags: str) -> ServerProcess:
    log = plan.out / f"server-{name}-{len(list(plan.out.glob('server-*.log')))}.log"
    return start_server(["--model-base-path", str(base), "--model-name", name, "--drain-delay-s", "0", *flags],
                        log, env=env, timeout=300)


def served_devices(server: ServerProcess) -> list[str]:
    for line in server.log().splitlines():
        if " devices=" in line and "serving model=" in line:
            return line.split(" devices=", 1)[1].split()[0].split(",")
    return []


def check_devices(plan: Plan, server: ServerProcess) -> Check:
    devices = served_devices(server)
    if not plan.gpu:
        return Check("1 devices", None, f"no GPU (nvidia-smi: none); replicas on {', '.join(devices)}")
    cards = nvidia_smi("--query-gpu=name,memory.total")
    gpus = [d for d in devices if "GPU" in d.upper()]
    return Check("1 devices", len(gpus) == 2, f"nvidia-smi: {'; '.join(cards)}; replicas on {', '.join(devices)}")


def check_answers(plan: Plan, base: Path, server: ServerProcess, env: dict[str, str]) -> Check:
    """Check 2: both official clients, every size at once, against the in-process model."""
    rng = np.random.default_rng(5)
    shape = SHAPES["mlp"][1][1:]
    inputs: dict[str, Any] = {f"r{i:02d}": rng.standard_normal((rows, *shape)).astype(np.float32)
              for i, rows in enumerate(plan.sizes * (1 if plan.short else 2))}
    np.savez(plan.out / "inputs.npz", **inputs)
    run_python(["-m", "bench.model_outputs", str(base), str(plan.out / "inputs.npz"), str(plan.out / "expected.npz")],
               600, env)
    before = [server.metric("mirrorserve_replica_rows_total", replica=str(r)) for r in (0, 1)]
    official = os.environ.get("OFFICIAL_CLIENT_PATH") or str(ROOT / ".venv" / "official")
    triton = os.environ.get("TRITON_CLIENT_PATH") or str(ROOT / ".venv" / "tritonclient")
    scripts = ROOT / "tests" / "integration"
    run_python([str(scripts / "official_client.py"), server.target, "mlp", str(plan.out / "inputs.npz"),
                str(plan.out / "official.npz")], 600, {"PYTHONPATH": official})
    run_python([str(scripts / "triton_client.py"), server.target, "mlp", "x", str(plan.out / "inputs.npz"),
                str(plan.out / "triton.npz")], 600, {"PYTHONPATH": triton})
    after = [server.metric("mirrorserve_replica_rows_total", replica=str(r)) for r in (0, 1)]
    worst = 0.0
    wrong = []
    with np.load(plan.out / "expected.npz") as expected:
        for client in ("official", "triton"):
            with np.load(plan.out / f"{client}.npz") as got:
                for key in expected.files:
                    difference = float(np.max(np.abs(got[key] - expected[key]), initial=0.0))
                    scale = float(np.max(np.abs(expected[key]), initial=1.0))
                    worst = max(worst, difference / scale)
                    if got[key].shape != expected[key].shape or difference > 1e-4 * scale:
                        wrong.append(f"{client} {key}")
    rows = sum(plan.sizes) * (1 if plan.short else 2) * 2
    worked = [a - b for a, b in zip(after, before, strict=True)]
    passed = not wrong and all(w > 0 for w in worked) and sum(worked) >= rows
    return Check("2 answers", passed, f"{len(inputs)} requests of {min(plan.sizes)}-{max(plan.sizes)} rows per "
                 f"client, 2 clients: {'all equal' if not wrong else 'WRONG: ' + ', '.join(wrong[:5])} (worst "
                 f"difference {worst:.1e} of the largest value); replica rows {worked[0]:.0f} + {worked[1]:.0f}")


def ceiling(base: Path, model: str, env: dict[str, str], plan: Plan) -> float:
    """The in-process rows/s at batch 64 (bench.inprocess)."""
    row = plan.out / f"{model}-row.npy"
    np.save(row, np.random.default_rng(0).standard_normal(SHAPES[model][1]).astype(np.float32))
    found = run_json(["-m", "bench.inprocess", str(base), str(row), str(plan.out / f"{model}-response.pb"),
                      str(plan.seconds), "64"], 600, env)
    return float(found["rows_per_s"]["64"])


def check_throughput(plan: Plan, bases: dict[str, Path], replicas: dict[str, str]) -> tuple[Check, list[str]]:
    """Check 3: the closed-loop bench client at each level, on each device kind, with its ceiling."""
    table = ["| model | device | callers | req/s | p50 ms | in-process rows/s (batch 64) | server / in-process |",
             "|---|---|---|---|---|---|---|"]
    failures = []
    opts = argparse.Namespace(warmup_s=0.5 if plan.short else 1.0, seconds=plan.seconds)
    for model in plan.models:
        for label, env in plan.devices():
            best = ceiling(bases[model], model, env, plan)
            server = serve(plan, bases[model], model, env, "--replicas", replicas[label])
            try:
                row = plan.out / f"{model}-row.npy"
                for level in plan.levels(model):
                    quiet = io.StringIO()  # the client's own table: one table here
                    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                        run = measure(f"127.0.0.1:{server.port},{server.rest_port}", model, row, opts,
                                      ["--concurrency", str(level)], server.process.pid)
                    if set(run.codes) != {"OK"}:
                        failures.append(f"{model} {label} C={level}: {run.codes}")
                    table.append(f"| {model} | {label} ({replicas[label]} replicas) | {level} | {run.req_per_s:,.0f} | "
                                 f"{run.p50_ms:.2f} | {best:,.0f} | {run.req_per_s / best:.2f} |")
            finally:
                server.stop()
    return Check("3 throughput", not failures, "; ".join(failures) or "every call OK; table below"), table


def check_memory(plan: Plan, base: Path) -> Check:
    """Check 4: the worker's GPU memory after each of 5 load/unload cycles (memory growth on)."""
    if not plan.gpu:
        return Check("4 memory", None, "no GPU")
    repository = plan.out / "repository"
    shutil.copytree(base, repository / "mlp", dirs_exist_ok=True)
    (plan.out / "tokens").write_text(f"checker {TOKEN}\n")
    server = start_server(["--model-repository", str(repository), "--model-control-mode", "explicit",
                           "--load-model", "mlp", "--enable-model-management", "--admin-token-file",
                           str(plan.out / "tokens"), "--replicas", "1", "--drain-delay-s", "0"],
                          plan.out / "server-memory.log", env={"TF_FORCE_GPU_ALLOW_GROWTH": "true"}, timeout=300)
    used = []
    try:
        for _ in range(5):
            for verb in ("unload", "load"):
                post(server, f"/v2/repository/models/mlp/{verb}")
            used.append(worker_gpu_mb(server))
    finally:
        server.stop()
    flat = max(used) - used[0] <= MEMORY_SLACK_MB
    return Check("4 memory", flat, f"worker GPU MB after each cycle: {', '.join(str(u) for u in used)}")


def post(server: ServerProcess, path: str) -> None:
    request = urllib.request.Request(f"{server.rest_url}{path}", data=b"{}", method="POST",
                                     headers={"authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        answer.read()


def worker_gpu_mb(server: ServerProcess) -> int:
    """GPU memory held by the server's processes (the model worker is its child), per nvidia-smi;
    the whole card's use where nvidia-smi shows no process of ours (inside a container it may not
    see their process ids)."""
    children = subprocess.run(["pgrep", "-P", str(server.process.pid)], capture_output=True, text=True,
                              check=False).stdout.split()
    pids = {str(server.process.pid), *children}
    found = [int(memory) for pid, _, memory in (line.replace(" ", "").partition(",")
                                                for line in nvidia_smi("--query-compute-apps=pid,used_memory"))
             if pid in pids]
    if found:
        return sum(found)
    return int(nvidia_smi("--query-gpu=memory.used", "-i", "0")[0])


def run(plan: Plan) -> tuple[list[Check], list[str]]:
    bases = build_models(plan.models, plan.out / "models", {"CUDA_VISIBLE_DEVICES": ""})
    replicas = {"GPU": "2", "CPU": "2" if not plan.gpu else "1"}
    checks: list[Check] = []
    table: list[str] = []
    strict = {"NVIDIA_TF32_OVERRIDE": "0"}  # exact enough to compare answers on the GPU
    env = strict if plan.gpu else {"CUDA_VISIBLE_DEVICES": ""}
    server = serve(plan, bases["mlp"], "mlp", env, "--replicas", "2", "--max-batch-size", "64")
    try:
        checks.append(check_devices(plan, server))
        checks.append(guarded("2 answers", lambda: check_answers(plan, bases["mlp"], server, env)))
    finally:
        server.stop()

    def measured() -> Check:
        check, rows = check_throughput(plan, bases, replicas)
        table.extend(rows)
        return check

    checks.append(guarded("3 throughput", measured))
    checks.append(guarded("4 memory", lambda: check_memory(plan, bases["mlp"])))

    def swept() -> Check:
        check, rows = check_frontends(plan)
        table.extend(rows)
        return check

    checks.append(guarded("5 front-ends", swept))
    return checks, table


def check_frontends(plan: Plan) -> tuple[Check, list[str]]:
    """--frontends 1, 2, 4 and 8 on the GPU machine's cores (bench.frontends: perf_analyzer, a
    connection per caller): the sweep the 2-core machine cannot show. Reported, not judged: it
    fails only if a run fails."""
    if not plan.gpu:
        return Check("5 front-ends", None, "GPU machine only; `make bench-frontends` measures 1, 2, 4 here"), []
    from bench import frontends

    out = plan.out / "frontends"
    frontends.main(["--model", "mlp", "--frontends", "1,2,4,8", "--concurrency", "1,64", "--repeat", "1",
                    "--out", str(out)])
    rows = (out / "frontends-mlp.md").read_text().splitlines()
    wide = [r for r in rows if r.startswith("| grpc | 64 | 8 |")]
    return Check("5 front-ends", True, wide[0] if wide else "see the table"), ["", *rows]


def guarded(name: str, check: Callable[[], Check]) -> Check:
    """A check that raised fails with its error, and the others still run."""
    try:
        return check()
    except Exception as exc:  # the table must still come out
        return Check(name, False, f"{type(exc).__name__}: {str(exc)[-1500:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="small counts (make test's dry run)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-check")
    args = parser.parse_args(argv)
    cards = nvidia_smi("--query-gpu=name")
    plan = Plan(gpu=bool(cards), short=args.short, out=args.out)
    shutil.rmtree(plan.out, ignore_errors=True)
    plan.out.mkdir(parents=True)
    started = time.monotonic()
    if plan.gpu:
        print(f"gpu-check on {len(cards)} GPU(s): {', '.join(cards)}", flush=True)
    else:
        print("gpu-check DRY RUN: no GPU here; checks 2-3 run on 2 logical CPU devices, 1, 4 and 5 are skipped",
              flush=True)
    checks, table = run(plan)
    print("\n| check | result | detail |\n|---|---|---|")
    for check in checks:
        result = "skipped" if check.passed is None else "PASS" if check.passed else "FAIL"
        print(f"| {check.name} | {result} | {check.detail} |")
    if table:
        print("\n" + "\n".join(table))
    print(f"\n{time.monotonic() - started:.0f} s")
    (plan.out / "results.json").write_text(json.dumps({
        "gpu": plan.gpu, "short": plan.short, "checks": [dataclasses.asdict(c) for c in checks], "table": table}))
    return 1 if any(c.passed is False for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
