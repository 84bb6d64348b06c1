"""Property-based fuzzing of Classify, Regress and MultiInference, as test_fuzz does Predict:
requests with examples near and far from what the models read (features of every kind and
length, absent or with no list set, conflicting contexts, bytes that are no tf.Example, broken
serializations), unknown models and signatures, odd task lists, raw garbage on the three method
paths, and random REST bodies for :classify and :regress. Whatever arrives, the answer names a
client problem (never INTERNAL, UNKNOWN or HTTP 500), and well-formed calls keep being served:
no example that passes the checks can fail the model, and with it a batch shared with others.
"""

from __future__ import annotations

import http.client
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.tensorflow_serving import serialized_input_pb2
from protos.tf.tensorflow.core.example import example_pb2
from tests.integration.conftest import ServerProcess, start_server
from tests.integration.example_models import build_classifier, build_regressor, build_scorer, example
from tests.integration.test_fuzz import FUZZ_SETTINGS, TIMEOUT_S

SERVICE = "/tensorflow.serving.PredictionService/"
METHODS = ("Classify", "Regress", "MultiInference")
ALLOWED = frozenset({grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                     grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED})
MODEL_NAMES = ("classifier", "scorer", "regressor", "nope", "")
SIGNATURES = ("", "serving_default", "regress", "predict", "bad_scores", "zz")
METHOD_NAMES = ("tensorflow/serving/classify", "tensorflow/serving/regress", "tensorflow/serving/predict", "", "x")
FEATURES = ("x", "age", "tags", "other")
KINDS = ("float_list", "int64_list", "bytes_list", None)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("fuzz-examples")
    for name, build in (("classifier", build_classifier), ("scorer", build_scorer), ("regressor", build_regressor)):
        build(root / name / "1")
    config = root / "models.config"
    config.write_text("model_config_list { " + " ".join(
        f'config {{ name: "{n}" base_path: "{root / n}" }}' for n in ("classifier", "scorer", "regressor")) + " }")
    server = start_server(["--model-config-file", str(config), "--batch-timeout-ms", "1", "--max-batch-size", "16",
                           "--max-message-bytes", str(1 << 20), "--drain-delay-s", "0"], Path(root / "server.log"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def channel(fuzz_server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(fuzz_server.target) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield channel


@st.composite
def features(draw: st.DrawFn) -> bytes:
    """A tf.Example near what the models read, serialized: each feature of a random kind and length,
    or with no list set; mostly the right "x"."""
    built = example_pb2.Example()
    if draw(st.booleans()):
        built.features.feature["x"].float_list.value.extend([1.0, 2.0])
    for name in draw(st.lists(st.sampled_from(FEATURES), max_size=3)):
        kind = draw(st.sampled_from(KINDS))
        feature = built.features.feature[name]
        feature.Clear()
        if kind is None:
            continue
        count = draw(st.integers(0, 3))
        values = getattr(feature, kind)
        values.SetInParent()
        values.value.extend([b"v"] * count if kind == "bytes_list" else [draw(st.integers(-3, 3))] * count)
    data: bytes = built.SerializeToString()
    return data


@st.composite
def serialized_examples(draw: st.DrawFn) -> bytes:
    raw = draw(features())
    how = draw(st.sampled_from(["as is", "as is", "as is", "truncated", "flipped", "random"]))
    if how == "truncated" and raw:
        return raw[:draw(st.integers(0, len(raw) - 1))]
    if how == "flipped" and raw:
        at = draw(st.integers(0, len(raw) - 1))
        return raw[:at] + bytes([raw[at] ^ (1 << draw(st.integers(0, 7)))]) + raw[at + 1:]
    if how == "random":
        return draw(st.binary(max_size=24))
    return raw


FITTING = (("Classify", "classifier", ""), ("Classify", "scorer", ""), ("Regress", "regressor", ""),
           ("Regress", "classifier", "regress"), ("MultiInference", "classifier", ""))
"""Calls the models can answer: (method, model, signature)."""


@st.composite
def good_examples(draw: st.DrawFn) -> bytes:
    x = draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=2, max_size=2))
    age = draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)))
    tags = draw(st.one_of(st.none(), st.lists(st.text(max_size=3), max_size=3)))
    data: bytes = example(x, age, tags).SerializeToString()
    return data


@st.composite
def good_requests(draw: st.DrawFn) -> tuple[str, bytes]:
    """A call that fits (its examples maybe with a context holding "tags"), at times with one
    example broken."""
    method, model, signature = draw(st.sampled_from(FITTING))
    examples = draw(st.lists(good_examples(), min_size=1, max_size=8))
    if draw(st.integers(0, 4)) == 0:
        examples[draw(st.integers(0, len(examples) - 1))] = draw(serialized_examples())
    if method == "MultiInference":
        message: Any = serialized_input_pb2.SerializedMultiInferenceRequest()
        for task_signature, method_name in (("", METHOD_NAMES[0]), ("regress", METHOD_NAMES[1])):
            task = message.tasks.add(method_name=method_name)
            task.model_spec.name = model
            task.model_spec.signature_name = task_signature
    else:
        message = serialized_input_pb2.SerializedExamplesRequest()
        message.model_spec.name = model
        message.model_spec.signature_name = signature
    if draw(st.booleans()):
        message.input.example_list.examples.extend(examples)
    else:
        message.input.example_list_with_context.examples.extend(
            e for e in examples if b"tags" not in e)
        message.input.example_list_with_context.context = example(tags=["c"]).SerializeToString()
    data: bytes = message.SerializeToString()
    return method, data


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    if draw(st.booleans()):
        return draw(good_requests())
    method = draw(st.sampled_from(METHODS))
    if method == "MultiInference":
        message: Any = serialized_input_pb2.SerializedMultiInferenceRequest()
        model = draw(st.sampled_from(MODEL_NAMES[:3]))
        for _ in range(draw(st.integers(0, 3))):
            task = message.tasks.add(method_name=draw(st.sampled_from(METHOD_NAMES)))
            task.model_spec.name = model if draw(st.integers(0, 9)) else draw(st.sampled_from(MODEL_NAMES))
            task.model_spec.signature_name = draw(st.sampled_from(SIGNATURES))
    else:
        message = serialized_input_pb2.SerializedExamplesRequest()
        message.model_spec.name = draw(st.sampled_from(MODEL_NAMES))
        message.model_spec.signature_name = draw(st.sampled_from(SIGNATURES))
        if draw(st.integers(0, 9)) == 0:
            message.model_spec.version.value = draw(st.integers(-2, 3))
    kind = draw(st.sampled_from(["example_list", "example_list_with_context", None]))
    if kind is not None:
        holder = getattr(message.input, kind)
        holder.examples.extend(draw(st.lists(serialized_examples(), max_size=6)))
        if kind == "example_list_with_context":
            holder.context = draw(serialized_examples()) if draw(st.booleans()) else example(age=4).SerializeToString()
    data: bytes = message.SerializeToString()
    return method, data


def _call(channel: grpc.Channel, method: str, data: bytes) -> tuple[grpc.StatusCode, str]:
    stub = channel.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None)
    try:
        stub(data, timeout=TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _still_serving(server: ServerProcess, channel: grpc.Channel) -> None:
    good = serialized_input_pb2.SerializedExamplesRequest()
    good.model_spec.name = "classifier"
    good.input.example_list.examples.append(example([1, 2]).SerializeToString())
    assert _call(channel, "Classify", good.SerializeToString())[0] == grpc.StatusCode.OK
    assert server.process.poll() is None, "the server process exited"


def test_fuzz_classify_regress_and_multi_inference(fuzz_server: ServerProcess, channel: grpc.Channel) -> None:
    counts: Counter[str] = Counter()

    @settings(max_examples=1500, **FUZZ_SETTINGS)
    @given(case=requests())
    def check(case: tuple[str, bytes]) -> None:
        method, data = case
        code, details = _call(channel, method, data)
        counts[code.name] += 1
        assert code in ALLOWED, (method, code, details, data[:2000])

    check()
    _still_serving(fuzz_server, channel)
    print(f"\nexample calls: {sum(counts.values())}; " + ", ".join(f"{k}={v}" for k, v in counts.most_common()))
    assert counts["OK"] > 50 and counts["INVALID_ARGUMENT"] > 50, counts


def test_fuzz_garbage_on_the_example_methods(fuzz_server: ServerProcess, channel: grpc.Channel) -> None:
    counts: Counter[str] = Counter()

    @settings(max_examples=400, **FUZZ_SETTINGS)
    @given(method=st.sampled_from(METHODS), data=st.binary(max_size=200))
    def check(method: str, data: bytes) -> None:
        code, details = _call(channel, method, data)
        counts[code.name] += 1
        assert code in ALLOWED, (method, code, details, data)

    check()
    _still_serving(fuzz_server, channel)
    print(f"\ngarbage: {sum(counts.values())}; " + ", ".join(f"{k}={v}" for k, v in counts.most_common()))


json_leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                        st.text(max_size=4), st.fixed_dictionaries({"b64": st.sampled_from(["AAE=", "!", ""])}))
json_features = st.dictionaries(st.sampled_from(FEATURES), st.one_of(
    json_leaves, st.lists(json_leaves, max_size=3), st.just([1.0, 2.0]), st.lists(st.lists(json_leaves, max_size=2),
                                                                                    max_size=2)), max_size=4)
good_json = st.fixed_dictionaries({"x": st.lists(st.floats(-1e3, 1e3, width=32), min_size=2, max_size=2)},
                                  optional={"age": st.integers(-(2**63), 2**63 - 1),
                                            "tags": st.lists(st.text(max_size=3), max_size=3)})
json_bodies = st.one_of(
    st.fixed_dictionaries({"examples": st.lists(good_json, min_size=1, max_size=5)}),
    st.fixed_dictionaries({"examples": st.lists(st.one_of(json_features, json_leaves), max_size=4)},
                          optional={"context": st.one_of(json_features, json_leaves),
                                    "signature_name": st.sampled_from(SIGNATURES),
                                    "instances": st.just([])}),
    json_leaves, st.lists(json_leaves, max_size=3))


def test_fuzz_rest_example_bodies(fuzz_server: ServerProcess) -> None:
    counts: Counter[int] = Counter()
    host = fuzz_server.rest_url.split("//")[1]
    connection = http.client.HTTPConnection(host, timeout=TIMEOUT_S)

    @settings(max_examples=500, **FUZZ_SETTINGS)
    @given(body=json_bodies, path=st.sampled_from(["/v1/models/classifier:classify", "/v1/models/regressor:regress",
                                                   "/v1/models/classifier:regress", "/v1/models/scorer:classify"]))
    def check(body: Any, path: str) -> None:
        connection.request("POST", path, json.dumps(body).encode())
        response = connection.getresponse()
        answer = response.read()
        counts[response.status] += 1
        assert response.status in (200, 400, 404, 429), (path, body, response.status, answer[:500])

    try:
        check()
    finally:
        connection.close()
    print(f"\nREST example bodies: {sum(counts.values())}; " + ", ".join(f"{k}={v}" for k, v in counts.most_common()))
    assert counts[200] > 20 and counts[400] > 20, counts
