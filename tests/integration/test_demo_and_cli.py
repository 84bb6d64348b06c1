"""What `make serve` runs: `python -m server` with no model path serves the built-in demo model
(built once into a cache), and `python -m client predict` prints a prediction from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from client import PredictClient
from tests.integration.conftest import ROOT, start_server


def test_demo_server_and_cli_predict(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {"MIRRORSERVE_CACHE_DIR": str(cache), "MIRRORSERVE_MAX_BATCH_SIZE": "16", "MIRRORSERVE_REPLICAS": "2"}
    server = start_server([], tmp_path / "first.log", env=env)
    try:
        line = next(x for x in server.log().splitlines() if "serving model=" in x)
        for fragment in ("model=demo", "version=1", "signatures=serving_default", "replicas=2",
                         "devices=/device:CPU:0,/device:CPU:1", "max_batch_size=16", "batch_timeout=auto", "inflight=1",
                         "max_queued_rows=4096"):
            assert fragment in line, (fragment, line)
        done = subprocess.run(
            [sys.executable, "-m", "client", "predict", "--target", f"localhost:{server.port}",
             "--model", "demo", "--rows", "2"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "output probabilities: float32 [2, 3]" in done.stdout, done.stdout
        assert "output class_id: int64 [2]" in done.stdout, done.stdout

        bad = subprocess.run(
            [sys.executable, "-m", "client", "predict", "--target", f"localhost:{server.port}", "--model", "nope"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        assert bad.returncode == 1
        assert "NOT_FOUND" in bad.stderr and "model 'nope' not found" in bad.stderr
    finally:
        assert server.stop() == 0

    built = cache / "demo-r1" / "1" / "saved_model.pb"
    stamp = built.stat().st_mtime_ns
    again = start_server([], tmp_path / "second.log", env=env)
    assert again.stop() == 0
    assert built.stat().st_mtime_ns == stamp, "the demo model was rebuilt instead of reused"
    assert not [p for p in cache.iterdir() if p.name.startswith(".building-")]


def test_bad_model_path_exits_with_message(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "server", "--model-base-path", str(tmp_path / "missing"), "--port", "0",
         "--rest-api-port", "-1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert "is not a folder" in done.stderr


def test_a_file_url_base_path_serves_and_another_scheme_stops_the_start(model_dirs: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    """TF Serving reads gs:// and s3:// through TensorFlow's file systems; here a base path is a
    local folder, file:// included, and any other scheme stops the start (exit 2) saying why."""
    server = start_server(["--model-base-path", f"file://{model_dirs['echo']}", "--model-name", "echo",
                           "--drain-delay-s", "0"], tmp_path / "file.log")
    try:
        with PredictClient(server.target) as client:
            assert client.predict("echo", {"x": np.array([[1, 2]], np.int64)})["y"].tolist() == [[1, 2]]
    finally:
        assert server.stop() == 0
    for args in (["--model-base-path", "gs://bucket/models/echo"],
                 ["--model-config-file", str(tmp_path / "models.config")]):
        (tmp_path / "models.config").write_text('model_config_list { config { name: "m" base_path: "s3://b/m" } }')
        done = subprocess.run([sys.executable, "-m", "server", *args, "--port", "0", "--rest-api-port", "-1"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr[-2000:]
        scheme = "gs" if args[0] == "--model-base-path" else "s3"
        assert f"the {scheme}:// scheme is not served here" in done.stderr and "copy or mount the model" in done.stderr
