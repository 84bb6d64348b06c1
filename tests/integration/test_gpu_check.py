"""`make gpu-check`'s script, in its short dry run (no GPU here): checks 2 and 3 on two logical CPU
devices, so the script that runs when a GPU is lent cannot rot unseen; its cnn at 1 caller runs
every batch on fewer rows than replicas."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, triton_client_path
from tests.integration.test_official_client import official_client_path


@pytest.mark.slow
def test_the_gpu_check_dry_run_passes(tmp_path: Path) -> None:
    env = {**os.environ, "OFFICIAL_CLIENT_PATH": official_client_path(), "TRITON_CLIENT_PATH": triton_client_path(),
           "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--short", "--out", str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = done.stdout.splitlines()
    gpu = json.loads((tmp_path / "out" / "results.json").read_text())["gpu"]
    if not gpu:
        assert lines[0].startswith("gpu-check DRY RUN: no GPU here; checks 2-3 run on 2 logical CPU devices")
    results = {c["name"]: c for c in json.loads((tmp_path / "out" / "results.json").read_text())["checks"]}
    assert results["2 answers"]["passed"] is True, results
    assert "all equal" in results["2 answers"]["detail"]
    assert results["3 throughput"]["passed"] is True, results
    assert "| mlp | CPU (2 replicas) | 16 |" in done.stdout
    assert "| cnn | CPU (2 replicas) | 1 |" in done.stdout  # 1-row batches on 2 replicas: one of them idles
    if not gpu:
        assert results["5 front-ends"]["passed"] is None, results  # the sweep needs the GPU machine's cores
