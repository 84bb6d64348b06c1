"""The replica path on the model families users serve (tests/integration/zoo_models.py: conv +
batch-norm, GRU/LSTM, attention with layer norm, integer and string inputs, and a model that
refuses empty batches): with 1, 2 and 3 replicas, requests of 1, 2, 3, 5 and 7 rows, each alone
and all at once, through TF Serving's official client. Every answer equals the model called
in-process on the same rows, within the model's stated tolerance; no replica ever runs an empty
shard; and mirrorserve_replica_rows_total counts only the rows clients sent."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.launch import poll_until
from tests.integration.conftest import ROOT, SERVING, start_server
from tests.integration.test_official_client import official_client_path
from tests.integration.zoo_models import ZOO, ensure_zoo

SIZES = (1, 2, 3, 5, 7)
COPIES = 3
"""All at once: each size this many times per model (75 requests in flight)."""
MAX_BATCH = 8
Requests = dict[str, dict[str, np.ndarray]]
"""'MODE/MODEL/REQUEST' -> that request's inputs."""


@pytest.fixture(scope="module")
def zoo() -> dict[str, Path]:
    return ensure_zoo()


@pytest.fixture(scope="module")
def requests() -> Requests:
    rng = np.random.default_rng(40)
    found: Requests = {}
    for name, model in ZOO.items():
        for i, rows in enumerate(SIZES):
            found[f"alone/{name}/r{i}"] = model.rows(rng, rows)
        for i, rows in enumerate(SIZES * COPIES):
            found[f"together/{name}/r{i}"] = model.rows(rng, rows)
    return found


@pytest.fixture(scope="module")
def expected(zoo: dict[str, Path], requests: Requests) -> dict[str, dict[str, np.ndarray]]:
    """Each request's answer from the model called in-process on that request's rows alone."""
    import tensorflow as tf

    functions = {name: tf.saved_model.load(str(base / "1")).signatures["serving_default"] for name, base in zoo.items()}
    return {key: {output: tensor.numpy() for output, tensor in
                  functions[key.split("/")[1]](**{k: tf.constant(v) for k, v in inputs.items()}).items()}
            for key, inputs in requests.items()}


def ask(target: str, requests: Requests, folder: Path) -> dict[str, Any]:
    """Every request through the official client (tests/integration/official_zoo_client.py)."""
    np.savez(folder / "requests.npz", **{f"{key}/{name}": array for key, inputs in requests.items()
                                         for name, array in inputs.items()})
    env = {**os.environ, "PYTHONPATH": official_client_path(), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "integration" / "official_zoo_client.py"), target,
                           str(folder / "requests.npz"), str(folder / "answers.npz")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(folder / "answers.npz", allow_pickle=True) as answers:
        return {key: answers[key] for key in answers.files}


def mismatches(answers: dict[str, Any], expected: dict[str, dict[str, np.ndarray]]) -> list[str]:
    wrong = []
    for key, outputs in expected.items():
        if f"{key}/error" in answers:
            wrong.append(f"{key}: {answers[f'{key}/error']}")
            continue
        tolerance = ZOO[key.split("/")[1]].tolerance
        for name, want in outputs.items():
            got = answers.get(f"{key}/{name}")
            if got is None or got.shape != want.shape or got.dtype != want.dtype:
                wrong.append(f"{key}/{name}: got {None if got is None else (got.dtype, got.shape)}, "
                             f"want {(want.dtype, want.shape)}")
            elif want.dtype.kind == "f":
                scale = max(float(np.max(np.abs(want))), 1.0)
                difference = float(np.max(np.abs(got - want)))
                if difference > tolerance * scale:
                    wrong.append(f"{key}/{name}: differs by {difference:.2e} (allowed {tolerance * scale:.2e})")
            elif not np.array_equal(got, want):
                wrong.append(f"{key}/{name}: {got.tolist()} != {want.tolist()}")
    return wrong


def model_config(zoo: dict[str, Path], folder: Path) -> Path:
    path = folder / "models.config"
    path.write_text("model_config_list {\n" + "".join(
        f'  config {{ name: "{name}" base_path: "{base}" model_platform: "tensorflow" }}\n'
        for name, base in zoo.items()) + "}\n")
    return path


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_every_zoo_answer_equals_the_model_in_process(replicas: int, zoo: dict[str, Path], requests: Requests,
                                                      expected: dict[str, dict[str, np.ndarray]],
                                                      tmp_path: Path) -> None:
    server = start_server(["--model-config-file", str(model_config(zoo, tmp_path)), "--replicas", str(replicas),
                           "--max-batch-size", str(MAX_BATCH), "--batch-timeout-ms", "5", "--drain-delay-s", "0"],
                          tmp_path / "server.log", timeout=240, ready=False)
    try:
        # A version that fails its warm-up is retried, and the server never serves: fail at once.
        served = poll_until(server.process, lambda: SERVING.search(server.log()) or
                            re.search(r"model=\S+ version=\d+ failed to load.*", server.log()), server.log_path, 240)
        assert served.re is SERVING, served.group(0)
        def replica_rows() -> dict[str, list[float]]:
            return {name: [server.metric("mirrorserve_replica_rows_total", model=name, replica=str(r))
                           for r in range(replicas)] for name in zoo}

        before = replica_rows()
        answers = ask(server.target, requests, tmp_path)
        after = replica_rows()
    finally:
        server.stop()
    wrong = mismatches(answers, expected)
    assert not wrong, f"{len(wrong)} wrong answers with {replicas} replicas:\n" + "\n".join(wrong[:20])
    log = server.log()
    assert "failed its warm-up" not in log and "Traceback" not in log, log[-3000:]
    for name in zoo:
        sent = sum(len(next(iter(inputs.values()))) for key, inputs in requests.items() if key.split("/")[1] == name)
        ran = [a - b for a, b in zip(after[name], before[name], strict=True)]
        assert sum(ran) == sent, f"{name}: replicas counted {ran} rows for the {sent} sent"
        assert all(rows > 0 for rows in ran), f"{name}: a replica ran none of the rows: {ran}"
