"""The official tensorflow-serving-api client, unchanged, against our server: outputs equal the
SavedModel called directly, for single, concurrent and over-budget requests, on 1 and 3 replicas."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration.conftest import ROOT

HERE = Path(__file__).resolve().parent
MAX_BATCH = 8


def official_client_path() -> str:
    path = os.environ.get("OFFICIAL_CLIENT_PATH") or str(ROOT / ".venv" / "official")
    if not (Path(path) / "tensorflow_serving" / "apis" / "predict_pb2.py").is_file():
        pytest.fail(f"tensorflow-serving-api not installed under {path}; run `make test`")
    return path


def run_official(target: str, model: str, inputs: dict[str, np.ndarray], tmp: Path) -> tuple[Any, dict[str, Any]]:
    np.savez(tmp / "in.npz", **inputs)
    env = {**os.environ, "PYTHONPATH": official_client_path(), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
        [sys.executable, str(HERE / "official_client.py"), target, model, str(tmp / "in.npz"), str(tmp / "out.npz")],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # Proof the official package answered, not our generated code.
    assert report["module"].startswith(official_client_path()), report["module"]
    with np.load(tmp / "out.npz") as out:
        return report, {k: out[k] for k in out.files}


@pytest.fixture(scope="module")
def demo_signature(model_dirs: dict[str, Path]) -> Any:
    import tensorflow as tf

    loaded = tf.saved_model.load(str(model_dirs["demo"] / "1"))
    return loaded, loaded.signatures["serving_default"]


CASES = {
    "single": lambda rng: {"r0": rng.standard_normal((1, 8)).astype(np.float32)},
    "concurrent64": lambda rng: {
        f"r{i:02d}": rng.standard_normal((int(rng.integers(1, 6)), 8)).astype(np.float32) for i in range(64)
    },
    "over_budget": lambda rng: {"big": rng.standard_normal((3 * MAX_BATCH + 5, 8)).astype(np.float32)},
}


@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_official_client_matches_direct_call(server_for, demo_signature, tmp_path: Path,
                                             replicas: int, case: str) -> None:
    server = server_for("demo", "--replicas", str(replicas), "--max-batch-size", str(MAX_BATCH),
                        "--batch-timeout-ms", "5")
    inputs = CASES[case](np.random.default_rng(replicas * 100 + len(case)))
    report, outputs = run_official(server.target, "demo", inputs, tmp_path)

    _, signature = demo_signature
    for key, x in inputs.items():
        expected = {k: v.numpy() for k, v in signature(x=x).items()}
        np.testing.assert_allclose(outputs[f"{key}/probabilities"], expected["probabilities"], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(outputs[f"{key}/class_id"], expected["class_id"])
        assert outputs[f"{key}/probabilities"].shape == (x.shape[0], 3)
    assert report["model_spec_versions"] == [1]

    serving = report["signatures"]["serving_default"]
    assert serving["inputs"] == {"x": [1, [-1, 8]]}  # DT_FLOAT
    assert serving["outputs"] == {"probabilities": [1, [-1, 3]], "class_id": [9, [-1]]}  # DT_INT64
    assert serving["method_name"] == "tensorflow/serving/predict"


@pytest.mark.parametrize("tensor_content", [False, True], ids=["typed-default", "tensor-content"])
def test_answers_read_the_way_tf_servings_example_client_reads_them(server_for, model_dirs: dict[str, Path],
                                                                    tmp_path: Path, tensor_content: bool) -> None:
    """mnist_client.py reads `result.outputs["scores"].float_val`: by default every value is there,
    in the dtype's own field, as TF Serving answers; --tensor-content-outputs (TF Serving's
    --enable_serialization_as_tensor_content) packs numbers in tensor_content instead."""
    import tensorflow as tf

    flags = ["--tensor-content-outputs"] if tensor_content else []
    server = server_for("typed", *flags)
    x = np.array([[1.25, -2.0], [0.5, 3.0], [-0.75, 0.0]], np.float32)
    np.save(tmp_path / "x.npy", x)
    env = {**os.environ, "PYTHONPATH": official_client_path(), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, str(HERE / "official_typed_client.py"), server.target, "typed",
                           str(tmp_path / "x.npy")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    expected = {k: v.numpy() for k, v in tf.saved_model.load(str(model_dirs["typed"] / "1")).signatures[
        "serving_default"](x=x).items()}
    fields = {"scores": "float_val", "half": "half_val", "count": "int64_val", "positive": "bool_val",
              "label": "string_val", "phase": "scomplex_val"}
    for name, want in expected.items():
        got = report[name]
        assert got["shape"] == list(want.shape), (name, got)
        if tensor_content and want.dtype != object:
            assert got["fields"] == {} and got["tensor_content_bytes"] == want.nbytes, (name, got)
            continue
        assert got["tensor_content_bytes"] == 0 and list(got["fields"]) == [fields[name]], (name, got)
        values = got["fields"][fields[name]]
        if name == "half":  # half_val carries float16 bits
            assert values == want.ravel().view(np.uint16).tolist(), (name, values)
        elif name == "label":
            assert values == [v.decode() for v in want.ravel()], (name, values)
        elif name == "phase":  # real, imaginary, real, ...
            assert values == want.ravel().view(np.float32).tolist(), (name, values)
        else:
            assert values == want.ravel().tolist(), (name, values, want)
