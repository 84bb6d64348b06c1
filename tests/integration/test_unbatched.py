"""Signatures without a batch dimension, served as TF Serving serves them without batching: the
Object Detection API's uint8 [1, -1, -1, 3] input with outputs that have no batch dimension, and
a scalar signature. Each request runs alone and whole (one model run, replica 0), concurrently
with others, through TF Serving's official client, and answers as the model in-process does;
the metadata reports the shapes as they are (v2 and Triton: max_batch_size 0)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from client import PredictClient, PredictError
from tests.integration.test_model_zoo import ask

SIZES = [(24, 32), (7, 5), (64, 48), (24, 32), (1, 1), (100, 3)]


def images(seed: int) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {f"together/detector/r{i}": {"images": rng.integers(0, 256, (1, h, w, 3), dtype=np.uint8)}
            for i, (h, w) in enumerate(SIZES)}


def test_one_image_requests_of_different_sizes_answer_concurrently(server_for, model_dirs: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    import tensorflow as tf

    server = server_for("detector", "--replicas", "2", "--max-batch-size", "8", "--batch-timeout-ms", "5")
    requests = images(3)
    before = server.metric("mirrorserve_batch_rows_count", model="detector")
    answers = ask([server.target], requests, tmp_path)
    runs = server.metric("mirrorserve_batch_rows_count", model="detector") - before
    detect = tf.saved_model.load(str(model_dirs["detector"] / "1")).signatures["serving_default"]
    for key, inputs in requests.items():
        want = {k: v.numpy() for k, v in detect(images=tf.constant(inputs["images"])).items()}
        for name, value in want.items():
            got = answers[f"0/{key}/{name}"]
            assert got.shape == value.shape and got.dtype == value.dtype, (key, name, got, value)
            np.testing.assert_allclose(got, value, rtol=1e-6)
    assert runs == len(SIZES)  # one run a request: never merged, never split
    replica_rows = [server.metric("mirrorserve_replica_rows_total", model="detector", replica=str(r)) for r in (0, 1)]
    assert replica_rows[1] == 0 and replica_rows[0] >= len(SIZES)  # whole, on one replica


def test_a_scalar_signature_and_shapes_checked_whole(server_for) -> None:
    server = server_for("detector", "--replicas", "2", "--max-batch-size", "8", "--batch-timeout-ms", "5")
    with PredictClient(server.target) as client:
        assert client.predict("detector", {"factor": np.float32(1.5)}, signature="scale")["twice"].tolist() == 3.0
        with pytest.raises(PredictError) as two_images:
            client.predict("detector", {"images": np.zeros((2, 4, 4, 3), np.uint8)})
        with pytest.raises(PredictError) as gray:
            client.predict("detector", {"images": np.zeros((1, 4, 4), np.uint8)})
    assert two_images.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'images' must have shape [1, -1, -1, 3], got [2, 4, 4, 3]" in two_images.value.details
    assert "served unbatched" in two_images.value.details
    assert gray.value.code == grpc.StatusCode.INVALID_ARGUMENT and "got [1, 4, 4]" in gray.value.details


def test_metadata_reports_the_shapes_as_they_are(server_for) -> None:
    server = server_for("detector", "--replicas", "2", "--max-batch-size", "8", "--batch-timeout-ms", "5")

    def get(path: str) -> dict[str, object]:
        with urllib.request.urlopen(f"{server.rest_url}{path}", timeout=10) as answer:
            return dict(json.loads(answer.read()))

    metadata = get("/v2/models/detector")
    assert metadata["inputs"] == [{"name": "images", "datatype": "UINT8", "shape": [1, -1, -1, 3]}]
    config = get("/v2/models/detector/config")
    assert config["max_batch_size"] == 0 and "dynamic_batching" not in config
    assert config["input"] == [{"name": "images", "data_type": "TYPE_UINT8", "dims": [1, -1, -1, 3],
                                "format": "FORMAT_NONE"}]
    log = server.log()
    assert "signature 'serving_default' is served unbatched" in log and "signature 'scale' is served unbatched" in log
