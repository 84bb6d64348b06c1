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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.launch import ServerProcess, poll_until, reap, spawn_server
from tests.integration.conftest import ROOT, SERVING
from tests.integration.test_official_client import official_client_path
from tests.integration.zoo_models import ZOO, ensure_zoo

SIZES = (1, 2, 3, 5, 7)
COPIES = 3
"""All at once: each size this many times per model (75 requests in flight)."""
MAX_BATCH = 8
REPLICAS = (1, 2, 3)
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


def ask(targets: list[str], requests: Requests, folder: Path) -> dict[str, Any]:
    """Every request to each target through the official client (official_zoo_client.py); the
    answers keyed "TARGET_INDEX/MODE/MODEL/REQUEST/OUTPUT"."""
    np.savez(folder / "requests.npz", **{f"{key}/{name}": array for key, inputs in requests.items()
                                         for name, array in inputs.items()})
    env = {**os.environ, "PYTHONPATH": official_client_path(), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "integration" / "official_zoo_client.py"),
                           str(folder / "requests.npz"), str(folder / "answers.npz"), *targets],
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


@dataclass
class Served:
    """What one server (one replica count) answered, and what it counted and logged meanwhile."""

    answers: dict[str, Any]
    replica_rows: dict[str, list[float]]
    """By model, the rows each replica ran for the requests."""
    log: str


@pytest.fixture(scope="module")
def served(zoo: dict[str, Path], requests: Requests, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Served]:
    """A server of the whole zoo with 1, 2 and 3 replicas (started together), each sent every
    request by one run of the official client."""
    folder = tmp_path_factory.mktemp("zoo")
    config = model_config(zoo, folder)
    spawned = {replicas: spawn_server(["--model-config-file", str(config), "--replicas", str(replicas),
                                       "--max-batch-size", str(MAX_BATCH), "--batch-timeout-ms", "5",
                                       "--drain-delay-s", "0"], folder / f"server-{replicas}.log")
               for replicas in REPLICAS}
    servers: dict[int, ServerProcess] = {}
    try:
        for replicas, process in spawned.items():
            servers[replicas] = serving(process, folder / f"server-{replicas}.log")

        def replica_rows() -> dict[int, dict[str, list[float]]]:
            return {replicas: {name: [server.metric("mirrorserve_replica_rows_total", model=name, replica=str(r))
                                      for r in range(replicas)] for name in zoo}
                    for replicas, server in servers.items()}

        before = replica_rows()
        answers = ask([servers[replicas].target for replicas in REPLICAS], requests, folder)
        after = replica_rows()
    finally:
        for process in spawned.values():
            process.terminate()
        for process in spawned.values():
            reap(process)
    return {replicas: Served({key.split("/", 1)[1]: value for key, value in answers.items()
                              if key.startswith(f"{index}/")},
                             {name: [a - b for a, b in zip(after[replicas][name], before[replicas][name], strict=True)]
                              for name in zoo},
                             (folder / f"server-{replicas}.log").read_text(errors="replace"))
            for index, replicas in enumerate(REPLICAS)}


def serving(process: subprocess.Popen[bytes], log: Path) -> ServerProcess:
    """The server once it serves; a version that fails its load is retried and the server never
    serves, so fail at its first failure rather than wait."""
    def ready() -> re.Match[str] | None:
        text = log.read_text(errors="replace")
        return SERVING.search(text) or re.search(r"model=\S+ version=\d+ failed to load.*", text)

    found = poll_until(process, ready, log, 240)
    assert found.re is SERVING, found.group(0)
    return ServerProcess(process, int(found.group(1)), int(found.group(2)), log)


@pytest.mark.parametrize("replicas", REPLICAS)
def test_every_zoo_answer_equals_the_model_in_process(replicas: int, served: dict[int, Served], requests: Requests,
                                                      expected: dict[str, dict[str, np.ndarray]]) -> None:
    found = served[replicas]
    wrong = mismatches(found.answers, expected)
    assert not wrong, f"{len(wrong)} wrong answers with {replicas} replicas:\n" + "\n".join(wrong[:20])
    assert "failed its warm-up" not in found.log and "Traceback" not in found.log, found.log[-3000:]


@pytest.mark.parametrize("replicas", REPLICAS)
def test_replicas_count_only_the_rows_clients_sent(replicas: int, served: dict[int, Served],
                                                   requests: Requests) -> None:
    for name, ran in served[replicas].replica_rows.items():
        sent = sum(len(next(iter(inputs.values()))) for key, inputs in requests.items() if key.split("/")[1] == name)
        assert sum(ran) == sent, f"{name}: replicas counted {ran} rows for the {sent} sent"
        assert all(rows > 0 for rows in ran), f"{name}: a replica ran none of the rows: {ran}"
