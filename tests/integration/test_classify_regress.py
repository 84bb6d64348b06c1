"""Classify, Regress and MultiInference on models exported with TensorFlow's own
classification_signature_def / regression_signature_def (tests/integration/example_models.py):
TF Serving's official client, unchanged, gets what the signatures return in-process on the same
examples, with and without context; concurrent calls share batches and each gets its own rows;
REST's :classify and :regress give the same; every bad input is INVALID_ARGUMENT naming the
example and the feature, and leaves other clients served; warmup and request-log records of these
kinds run and are written."""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from client.warmup_log import warmup_from_logs
from protos.tensorflow_serving import prediction_log_pb2, serialized_input_pb2
from server.api import tfrecords
from tests.integration.conftest import ServerProcess, start_server
from tests.integration.example_models import (
    LABELS,
    build_classifier,
    build_native,
    build_regressor,
    build_scorer,
    example,
    random_examples,
    reference,
)
from tests.integration.test_official_client import official_client_path

HERE = Path(__file__).resolve().parent
CLASSIFY = "tensorflow/serving/classify"
REGRESS = "tensorflow/serving/regress"
MODELS = {"classifier": build_classifier, "scorer": build_scorer, "regressor": build_regressor,
          "native": build_native}


@pytest.fixture(scope="module")
def example_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("example-models")
    for name, build in MODELS.items():
        build(root / name / "1")
    return {name: root / name for name in MODELS}


def config_text(models: Mapping[str, Path], logged: Path | None = None) -> str:
    entries = []
    for name, base in models.items():
        logging = (f' logging_config {{ log_collector_config {{ type: "file" filename_prefix: "{logged}" }} '
                   f'sampling_config {{ sampling_rate: 1.0 }} }}') if logged and name == "classifier" else ""
        entries.append(f'config {{ name: "{name}" base_path: "{base}" model_platform: "tensorflow"{logging} }}')
    return "model_config_list { " + " ".join(entries) + " }\n"


@pytest.fixture(scope="module")
def server(example_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """All three models; batches wait up to 50 ms for company, so concurrent calls share them."""
    folder = tmp_path_factory.mktemp("examples-server")
    config = folder / "models.config"
    config.write_text(config_text(example_models))
    started = start_server(["--model-config-file", str(config), "--batch-timeout-ms", "50", "--drain-delay-s", "0"],
                           folder / "server.log")
    yield started
    started.stop()


def run_official(target: str, calls: list[dict[str, Any]], tmp: Path) -> list[dict[str, Any]]:
    (tmp / "calls.json").write_text(json.dumps(calls))
    env = {**os.environ, "PYTHONPATH": official_client_path(), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, str(HERE / "official_example_client.py"), target, str(tmp / "calls.json"),
                           str(tmp / "results.json")], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["module"].startswith(official_client_path())
    results: list[dict[str, Any]] = json.loads((tmp / "results.json").read_text())
    return results


def call(method: str, model: str, examples: Sequence[bytes], context: bytes | None = None, signature: str = "",
         tasks: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    return {"method": method, "model": model, "signature": signature, "examples": [e.hex() for e in examples],
            "context": None if context is None else context.hex(), "tasks": list(tasks)}


def expected_classes(model_dir: Path, signature: str, examples: Sequence[bytes], context: bytes | None
                     ) -> tuple[list[list[str]], np.ndarray]:
    """The labels (all "" without classes) and scores the signature gives in-process."""
    outputs = reference(model_dir / "1", signature, examples, context)
    scores = outputs.get("scores")
    classes = outputs.get("classes")
    shape = (classes if classes is not None else scores).shape  # type: ignore[union-attr]
    labels = [[""] * shape[1]] * shape[0] if classes is None else [[c.decode() for c in row] for row in classes]
    return labels, np.zeros(shape, np.float32) if scores is None else scores


def assert_classes(got: list[list[list[Any]]], want: tuple[list[list[str]], np.ndarray]) -> None:
    labels, scores = want
    assert [[label for label, _ in row] for row in got] == labels
    np.testing.assert_allclose(np.array([[score for _, score in row] for row in got], np.float32), scores,
                               rtol=1e-5, atol=1e-6)


def expected_values(model_dir: Path, signature: str, examples: Sequence[bytes], context: bytes | None) -> np.ndarray:
    return reference(model_dir / "1", signature, examples, context)["outputs"].reshape(-1)


def test_the_official_client_gets_what_the_signatures_return(server: ServerProcess, example_models: dict[str, Path],
                                                             tmp_path: Path) -> None:
    rng = random.Random(1)
    plain = random_examples(rng, 3)
    shared = random_examples(rng, 4, context=True)
    context = example(age=77, tags=["ctx"]).SerializeToString()
    calls = [
        call("Classify", "classifier", plain), call("Classify", "classifier", shared, context),
        call("Classify", "scorer", plain), call("Classify", "scorer", shared, context),
        call("Regress", "regressor", plain), call("Regress", "classifier", shared, context, signature="regress"),
        call("MultiInference", "classifier", plain, tasks=[("", CLASSIFY), ("regress", REGRESS)]),
        call("MultiInference", "classifier", shared, context, tasks=[("regress", REGRESS), ("", CLASSIFY)]),
    ]
    results = run_official(server.target, calls, tmp_path)
    for sent, got in zip(calls, results, strict=True):
        assert "code" not in got, (sent, got)
    classifier, scorer, regressor = (example_models[m] for m in ("classifier", "scorer", "regressor"))
    assert_classes(results[0]["classes"], expected_classes(classifier, "serving_default", plain, None))
    assert [c[0] for c in results[0]["classes"][0]] == list(LABELS)
    assert results[0]["model_spec"] == {"name": "classifier", "version": 1, "signature": "serving_default"}
    assert_classes(results[1]["classes"], expected_classes(classifier, "serving_default", shared, context))
    assert_classes(results[2]["classes"], expected_classes(scorer, "serving_default", plain, None))
    assert {label for row in results[2]["classes"] for label, _ in row} == {""}  # scores only: no labels
    assert_classes(results[3]["classes"], expected_classes(scorer, "serving_default", shared, context))
    np.testing.assert_allclose(results[4]["values"], expected_values(regressor, "serving_default", plain, None),
                               rtol=1e-5)
    np.testing.assert_allclose(results[5]["values"], expected_values(classifier, "regress", shared, context),
                               rtol=1e-5)
    assert results[5]["model_spec"]["signature"] == "regress"
    for multi, examples, ctx in ((results[6], plain, None), (results[7], shared, context)):
        by_signature = {r["model_spec"]["signature"]: r for r in multi["results"]}
        assert_classes(by_signature["serving_default"]["classes"],
                       expected_classes(classifier, "serving_default", examples, ctx))
        np.testing.assert_allclose(by_signature["regress"]["values"],
                                   expected_values(classifier, "regress", examples, ctx), rtol=1e-5)
    assert [r["model_spec"]["signature"] for r in results[7]["results"]] == ["regress", "serving_default"]
    for api, count in (("Classify", 2), ("Regress", 1), ("MultiInference", 2)):
        assert server.metric(":tensorflow:serving:request_latency_count", model_name="classifier", API=api,
                             entrypoint="GRPC") >= count, api
        assert server.metric("mirrorserve_requests_total", model="classifier", method=api, code="OK") >= count, api


def test_concurrent_calls_share_batches_and_each_gets_its_own(server: ServerProcess, example_models: dict[str, Path],
                                                              tmp_path: Path) -> None:
    rng = random.Random(2)
    batches_before = server.metric("mirrorserve_batch_rows_count", model="classifier")
    rows_before = server.metric("mirrorserve_batch_rows_sum", model="classifier")
    sent = [random_examples(rng, rng.randrange(1, 5)) for _ in range(48)]
    results = run_official(server.target, [call("Classify", "classifier", examples) for examples in sent], tmp_path)
    everything = [e for examples in sent for e in examples]
    labels, scores = expected_classes(example_models["classifier"], "serving_default", everything, None)
    start = 0
    for examples, got in zip(sent, results, strict=True):
        assert_classes(got["classes"], (labels[start:start + len(examples)], scores[start:start + len(examples)]))
        start += len(examples)
    batches = server.metric("mirrorserve_batch_rows_count", model="classifier") - batches_before
    rows = server.metric("mirrorserve_batch_rows_sum", model="classifier") - rows_before
    print(f"48 calls, {len(everything)} examples, in {batches:.0f} batches")
    assert rows == len(everything)
    assert batches < len(sent) / 2, "concurrent calls share batches"


def raw_call(server: ServerProcess, method: str, request: bytes) -> tuple[grpc.StatusCode, str]:
    """Send bytes the official client cannot build (an example that is not a tf.Example)."""
    with grpc.insecure_channel(server.target) as channel:
        stub = channel.unary_unary(f"/tensorflow.serving.PredictionService/{method}",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            stub(request, timeout=30)
        except grpc.RpcError as error:
            return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def test_bad_input_is_named_and_other_clients_are_served(server: ServerProcess, tmp_path: Path) -> None:
    good = example([1, 2]).SerializeToString()
    cases: list[tuple[dict[str, Any], str]] = [
        (call("Classify", "classifier", [good, good, example(age=3).SerializeToString()]),
         "example 2: feature 'x' is missing; the model requires it (a float_list of 2 values)"),
        (call("Regress", "regressor", [good, example([1, 2, 3]).SerializeToString()]),
         "example 1: feature 'x' has 3 values; the model reads a float_list of 2 values"),
        (call("Classify", "classifier", [tagged_with_numbers()]),
         "example 0: feature 'tags' is a int64_list; the model reads it as a bytes_list of any length"),
        (call("Classify", "classifier", []), "input.example_list has no examples; send at least one"),
        (call("Classify", "classifier", [good, example([1, 2], age=4).SerializeToString()],
              example(age=5).SerializeToString()),
         "example 1 and the context both have feature 'age'; give each feature in one of them only"),
        (call("Classify", "classifier", [good], signature="predict"),
         "signature 'predict' (method_name 'tensorflow/serving/predict') cannot classify: a classify signature has "
         "exactly one input, 'inputs' (serialized tf.Examples); it has 'x'"),
        (call("Regress", "scorer", [good]), "cannot regress: a regress signature returns one output, 'outputs'; "
                                            "it returns 'scores'"),
        (call("Classify", "classifier", [good], signature="bad_scores"),
         "its output 'scores' has shape [-1]; it must be [batch_size, num_classes]"),
        (call("MultiInference", "classifier", [good], tasks=[("", CLASSIFY), ("", CLASSIFY)]),
         "Duplicate evaluation of signature: serving_default"),
        (call("MultiInference", "classifier", [good], tasks=[("", "tensorflow/serving/predict")]),
         "Unsupported signature method_name: 'tensorflow/serving/predict'"),
    ]
    results = run_official(server.target, [c for c, _ in cases] + [call("Classify", "classifier", [good])], tmp_path)
    for (sent, message), got in zip(cases, results, strict=False):
        assert message in got.get("details", ""), (sent, got)
        expected = "UNIMPLEMENTED" if "Unsupported" in message else "INVALID_ARGUMENT"
        assert got["code"] == expected, got
    assert "classes" in results[-1], "a good call beside the bad ones is answered"

    garbage = serialized_input_pb2.SerializedExamplesRequest()
    garbage.model_spec.name = "classifier"
    garbage.input.example_list.examples.extend([good, b"\xff\xfe garbage"])
    code, details = raw_call(server, "Classify", garbage.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(
        "example 1 is not a serialized tf.Example"), details
    multi = serialized_input_pb2.SerializedMultiInferenceRequest()
    for name in ("classifier", "scorer"):
        multi.tasks.add(method_name=CLASSIFY).model_spec.name = name
    multi.input.example_list.examples.append(good)
    code, details = raw_call(server, "MultiInference", multi.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(
        "All ModelSpecs in a MultiInferenceRequest must access the same model name"), details
    code, details = raw_call(server, "Regress", b"\x12\x03\x0a\x01\xff")
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details


def tagged_with_numbers() -> bytes:
    built = example([1, 2])
    built.features.feature["tags"].int64_list.value.append(7)
    data: bytes = built.SerializeToString()
    return data


def post(server: ServerProcess, path: str, body: Any) -> tuple[int, Any]:
    connection = http.client.HTTPConnection(server.rest_url.split("//")[1], timeout=60)
    try:
        connection.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_rest_classify_and_regress_give_the_same(server: ServerProcess, example_models: dict[str, Path]) -> None:
    examples = [{"x": [0.5, -1.25], "age": 40, "tags": ["a", "b"]}, {"x": [1.0, 2.0]}]
    as_protos = [example([0.5, -1.25], 40, ["a", "b"]).SerializeToString(), example([1, 2]).SerializeToString()]
    status, body = post(server, "/v1/models/classifier:classify", {"examples": examples})
    assert status == 200, body
    assert_classes(body["results"], expected_classes(example_models["classifier"], "serving_default", as_protos, None))
    context = {"age": 12}
    status, body = post(server, "/v1/models/classifier/versions/1:regress",
                        {"signature_name": "regress", "context": context,
                         "examples": [{"x": [3.0, 4.0]}, {"x": [1.5, 0.0]}]})
    assert status == 200, body
    np.testing.assert_allclose(body["results"], expected_values(
        example_models["classifier"], "regress", [example([3, 4]).SerializeToString(),
                                                  example([1.5, 0]).SerializeToString()],
        example(age=12).SerializeToString()), rtol=1e-5)
    status, body = post(server, "/v1/models/scorer:classify", {"examples": [{"x": [1.0, 2.0]}]})
    assert status == 200 and [label for label, _ in body["results"][0]] == ["", "", ""], body
    status, body = post(server, "/v1/models/classifier:classify", {"examples": [{"x": [1.0, 2.0]}, {"age": 3}]})
    assert status == 400 and body["error"].startswith("example 1: feature 'x' is missing"), body
    status, body = post(server, "/v1/models/regressor:regress", {"examples": []})
    assert status == 400 and body["error"] == "'examples' value is an empty array", body


def warmup_records(count: int) -> list[bytes]:
    """Classify, Regress and MultiInference records, as TF Serving's warmup files hold them."""
    good = example([1, 2]).SerializeToString()
    records = []
    for i in range(count):
        record = prediction_log_pb2.PredictionLog()
        kind = ("classify_log", "regress_log", "multi_inference_log")[i % 3]
        request = getattr(record, kind).request
        if kind == "multi_inference_log":
            for signature, method in (("", CLASSIFY), ("regress", REGRESS)):
                task = request.tasks.add(method_name=method)
                task.model_spec.signature_name = signature
        else:
            request.model_spec.signature_name = "" if kind == "classify_log" else "regress"
        request.input.example_list.examples.add().MergeFromString(good)
        records.append(record.SerializeToString())
    return records


def test_warmup_runs_these_records_and_the_log_writes_them(example_models: dict[str, Path], tmp_path: Path) -> None:
    base = tmp_path / "classifier"
    base.mkdir()
    shutil.copytree(example_models["classifier"] / "1", base / "1")
    (base / "1" / "assets.extra").mkdir()
    with tfrecords.Writer(base / "1" / "assets.extra" / "tf_serving_warmup_requests") as writer:
        for record in warmup_records(6):
            writer.write(record)
    prefix = tmp_path / "logs" / "requests"
    prefix.parent.mkdir()
    config = tmp_path / "models.config"
    config.write_text(config_text({"classifier": base}, logged=prefix))
    started = start_server(["--model-config-file", str(config), "--drain-delay-s", "0"], tmp_path / "server.log")
    try:
        assert f"from {base / '1' / 'assets.extra' / 'tf_serving_warmup_requests'}: 6 records, 6 requests" in (
            started.log()), started.log()
        good = example([1, 2]).SerializeToString()
        results = run_official(started.target, [call("Classify", "classifier", [good]),
                                                call("Regress", "classifier", [good], signature="regress"),
                                                call("MultiInference", "classifier", [good],
                                                     tasks=[("", CLASSIFY), ("regress", REGRESS)])], tmp_path)
        assert all("code" not in r for r in results), results
        deadline = time.monotonic() + 10
        kinds: list[str] = []
        while time.monotonic() < deadline and len(kinds) < 3:
            kinds = [prediction_log_pb2.PredictionLog.FromString(r).WhichOneof("log_type")
                     for path in sorted(prefix.parent.glob("requests.*")) for r in tfrecords.read(path)]
            time.sleep(0.1)
    finally:
        started.stop()
    assert sorted(kinds) == ["classify_log", "multi_inference_log", "regress_log"], kinds
    records = [prediction_log_pb2.PredictionLog.FromString(r)
               for path in sorted(prefix.parent.glob("requests.*")) for r in tfrecords.read(path)]
    classify = next(r.classify_log for r in records if r.WhichOneof("log_type") == "classify_log")
    assert classify.request.input.example_list.examples[0].SerializeToString() == good
    assert [c.label for c in classify.response.result.classifications[0].classes] == list(LABELS)
    written, read = warmup_from_logs(sorted(prefix.parent.glob("requests.*")), tmp_path / "warmup")
    assert (written, read) == (3, 3)
    replayed = [prediction_log_pb2.PredictionLog.FromString(r) for r in tfrecords.read(tmp_path / "warmup")]
    assert sorted(r.WhichOneof("log_type") for r in replayed) == ["classify_log", "multi_inference_log", "regress_log"]


def test_a_tf2_signature_classifies_unless_method_names_are_checked(server: ServerProcess,
                                                                     example_models: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    """TF2 writes every signature's method_name as predict: TF Serving (and this server) serve
    Classify on one shaped like a classifier unless --enable_signature_method_name_check, which
    refuses it; its features (parsed inside a nested function) are checked all the same."""
    good = [example([1, 2]).SerializeToString(), example([0.5, 0.25], 3, ["a"]).SerializeToString()]
    bad = [good[0], example(age=2).SerializeToString()]
    results = run_official(server.target, [call("Classify", "native", good), call("Classify", "native", bad)],
                           tmp_path)
    assert_classes(results[0]["classes"], expected_classes(example_models["native"], "serving_default", good, None))
    assert results[1] == {"code": "INVALID_ARGUMENT", "details": "example 1: feature 'x' is missing; the model "
                                                                 "requires it (a float_list of 2 values)"}
    config = tmp_path / "models.config"
    config.write_text(config_text({"native": example_models["native"], "classifier": example_models["classifier"]}))
    checked = start_server(["--model_config_file=" + str(config), "--enable_signature_method_name_check=true",
                            "--drain-delay-s", "0"], tmp_path / "server.log")
    try:
        results = run_official(checked.target, [call("Classify", "native", good),
                                                call("Classify", "classifier", good)], tmp_path)
    finally:
        checked.stop()
    assert results[0]["code"] == "INVALID_ARGUMENT" and results[0]["details"] == (
        "signature 'serving_default' (method_name 'tensorflow/serving/predict') cannot classify: Expected classify "
        "signature method_name to be tensorflow/serving/classify (--signature-method-name-check)"), results[0]
    assert "classes" in results[1], results[1]
