"""The checks on Classify / Regress examples (server.api.tfserving.tf_example), the REST JSON form of examples
(server.api.tfserving.tf_example_json), and TF Serving's signature and output rules
(server.core.example_methods). The checks are held to TensorFlow's own: on random examples, good
and broken, a check passes exactly when tf.io.parse_example does, with the spec read out of the
graph by the model worker's own code."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from protos.tensorflow_serving import serialized_input_pb2
from server.api.tfserving import tf_example, tf_example_json
from server.core.example_methods import CLASSIFY, REGRESS, ExampleMethods, check_classification, check_regression
from server.core.inference import Inference
from server.core.prediction import Predictor
from server.core.servables import Servable
from server.core.signatures import ExampleFeature, ModelInfo, Signature, SignatureDefinition, TensorSpec
from server.errors import InvalidInput, TooLargeInput
from server.worker.example_features import example_features, warm_up_example

X = ExampleFeature("float_list", (2,), True)
AGE = ExampleFeature("int64_list", (1,), False)
TAGS = ExampleFeature("bytes_list", None, False)
SEQ = ExampleFeature("float_list", (-1, 2), False)
FEATURES = {"x": X, "age": AGE, "tags": TAGS, "seq": SEQ}


def example(**features: Any) -> bytes:
    """An Example from kind=values pairs: x=("float_list", [1, 2]); None: a Feature with no list set."""
    built = tf.train.Example()
    for name, value in features.items():
        feature = built.features.feature[name]
        if value is None:
            feature.SetInParent()
            continue
        kind, values = value
        getattr(feature, kind).SetInParent()
        getattr(feature, kind).value.extend(values)
    data: bytes = built.SerializeToString()
    return data


GOOD = example(x=("float_list", [1, 2]))


def refused(examples: list[bytes], context: bytes = b"", features: Any = FEATURES) -> str:
    with pytest.raises(InvalidInput) as caught:
        tf_example.check(examples, context, features)
    return str(caught.value)


def test_each_bad_example_is_named_by_index_and_feature() -> None:
    assert refused([GOOD, b"\xff\xff\x01"]).startswith("example 1 is not a serialized tf.Example: ")
    assert refused([GOOD, GOOD, example(age=("int64_list", [3]))]) == (
        "example 2: feature 'x' is missing; the model requires it (a float_list of 2 values)")
    assert refused([example(x=None)]) == (
        "example 0: feature 'x' is missing; the model requires it (a float_list of 2 values)")
    assert refused([example(x=("int64_list", [1, 2]))]) == (
        "example 0: feature 'x' is a int64_list; the model reads it as a float_list of 2 values")
    assert refused([example(x=("float_list", [1, 2]), tags=("float_list", []))]) == (
        "example 0: feature 'tags' is a float_list; the model reads it as a bytes_list of any length")
    assert refused([example(x=("float_list", [1, 2, 3]))]) == (
        "example 0: feature 'x' has 3 values; the model reads a float_list of 2 values")
    assert refused([example(x=("float_list", [1, 2]), age=("int64_list", []))]) == (
        "example 0: feature 'age' has 0 values; the model reads an int64_list of 1 value")
    assert refused([example(x=("float_list", [1, 2]), seq=("float_list", [1, 2, 3]))]) == (
        "example 0: feature 'seq' has 3 values; the model reads a float_list of a multiple of 2 values")
    assert refused([b""]) == "example 0: feature 'x' is missing; the model requires it (a float_list of 2 values)"


def test_what_the_model_accepts_passes() -> None:
    tf_example.check([GOOD, example(x=("float_list", [1, 2]), age=("int64_list", [4]), tags=("bytes_list", [b"a"] * 9),
                                    seq=("float_list", [1, 2, 3, 4]), other=("int64_list", [1]), age2=None),
                      example(x=("float_list", [0, 0]), age=None, tags=None, seq=("float_list", []))], b"", FEATURES)


def test_context_features_count_and_conflicts_are_refused() -> None:
    context = example(x=("float_list", [1, 2]))
    tf_example.check([example(age=("int64_list", [1])), b""], context, FEATURES)
    assert refused([GOOD, example(age=("int64_list", [1]))], example(age=("int64_list", [1]))) == (
        "example 1 and the context both have feature 'age'; give each feature in one of them only")
    assert refused([GOOD], b"\x0a").startswith("the context is not a serialized tf.Example")
    # Without a known parse spec the examples are still parsed, and conflicts still refused.
    assert refused([GOOD, b"\x0a"], b"", None).startswith("example 1 is not a serialized tf.Example")
    assert refused([GOOD], GOOD, None).startswith("example 0 and the context both have feature 'x'")


def serialized_input(examples: list[bytes], context: bytes | None = None) -> Any:
    message = serialized_input_pb2.SerializedInput()
    if context is None:
        message.example_list.examples.extend(examples)
    else:
        message.example_list_with_context.examples.extend(examples)
        message.example_list_with_context.context = context
    return message


def test_input_shape_and_size() -> None:
    with pytest.raises(InvalidInput, match=r"the input is empty: set input\.example_list"):
        tf_example.examples_of(serialized_input_pb2.SerializedInput(), 1 << 20)
    with pytest.raises(InvalidInput, match=r"input\.example_list has no examples; send at least one"):
        tf_example.examples_of(serialized_input([]), 1 << 20)
    examples, context = tf_example.examples_of(serialized_input([GOOD, b""], b"ctx"), 1 << 20)
    assert (examples, context) == ([GOOD, b""], b"ctx")
    assert tf_example.merged(examples, context) == [b"ctx" + GOOD, b"ctx"]
    # A context is copied into every example: 100 empty examples and a 100 KB context are 10 MB.
    with pytest.raises(TooLargeInput, match="the examples merged with their context"):
        tf_example.examples_of(serialized_input([b""] * 100, b"c" * 100_000), 4 << 20)


def spec_of(spec: dict[str, Any]) -> dict[str, ExampleFeature] | None:
    """The features the worker reads out of a function that parses `spec`."""
    function = tf.function(lambda s: tf.io.parse_example(s, spec)).get_concrete_function(
        tf.TensorSpec([None], tf.string))
    return example_features(function)


TF_SPEC = {"x": tf.io.FixedLenFeature([2], tf.float32),
           "age": tf.io.FixedLenFeature([1], tf.int64, default_value=[30]),
           "tags": tf.io.VarLenFeature(tf.string),
           "seq": tf.io.FixedLenSequenceFeature([2], tf.float32, allow_missing=True),
           "r": tf.io.RaggedFeature(tf.int64),
           "name": tf.io.FixedLenFeature([], tf.string)}


def test_the_worker_reads_the_spec_out_of_the_graph() -> None:
    assert spec_of(TF_SPEC) == {
        "x": X, "age": AGE, "tags": TAGS, "seq": SEQ, "r": ExampleFeature("int64_list", None, False),
        "name": ExampleFeature("bytes_list", (), True)}
    assert example_features(tf.function(lambda s: {"n": tf.strings.length(s)}).get_concrete_function(
        tf.TensorSpec([None], tf.string))) is None
    features = spec_of(TF_SPEC)
    assert features is not None
    tf.io.parse_example([warm_up_example(features)], TF_SPEC)  # the warm-up example parses


RIGHT = {"x": ("float_list", [2]), "age": ("int64_list", [1]), "tags": ("bytes_list", [0, 1, 3]),
         "seq": ("float_list", [0, 2, 4]), "r": ("int64_list", [0, 2]), "name": ("bytes_list", [1])}
"""Each feature's kind and counts that TF_SPEC accepts."""


def random_feature(rng: random.Random, name: str) -> Any:
    """Mostly right for TF_SPEC, else of a random kind and length, or with no list set."""
    kind, counts = RIGHT[name]
    count = rng.choice(counts)
    if rng.random() < 0.15:
        kind = rng.choice(["float_list", "int64_list", "bytes_list", None])
        count = rng.choice([0, 1, 2, 3, 4])
    if kind is None:
        return None
    return kind, [rng.randrange(5) for _ in range(count)] if kind != "bytes_list" else [b"v"] * count


def test_a_check_passes_exactly_when_tensorflow_parses() -> None:
    """Random examples near the spec (features of the right or a random kind and length, absent,
    or with no list set), and random bytes: checked alone, each passes exactly when TensorFlow's
    parse op accepts it."""
    rng = random.Random(7)
    features = spec_of(TF_SPEC)
    agreed = {True: 0, False: 0}
    for trial in range(600):
        if trial % 50 == 0:
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 30)))
        else:
            raw = example(**{name: random_feature(rng, name) for name in TF_SPEC if rng.random() < 0.9})
        try:
            tf.io.parse_example([raw], TF_SPEC)
            parsed = True
        except (tf.errors.InvalidArgumentError, UnicodeDecodeError):
            parsed = False
        try:
            tf_example.check([raw], b"", features)
            passed = True
        except InvalidInput:
            passed = False
        assert passed == parsed, (raw, parsed)
        agreed[parsed] += 1
    assert min(agreed.values()) > 100, agreed  # both sides were exercised


def test_json_examples_are_typed_as_tf_serving_types_them() -> None:
    body = (b'{"signature_name": "s", "context": {"c": "text"}, "examples": [{"i": 3, "f": 1.5, "b": true, '
            b'"l": [1, 2], "fl": [1.0, 2], "s": ["a", {"b64": "AAE="}], "e": []}]}')
    name, examples, context = tf_example_json.decode_body(body, "classify", {}, 1 << 20, 100)
    assert name == "s"
    parsed = tf.train.Example.FromString(examples[0]).features.feature
    assert tf.train.Example.FromString(context).features.feature["c"].bytes_list.value == [b"text"]
    assert list(parsed["i"].int64_list.value) == [3]
    assert list(parsed["f"].float_list.value) == [1.5]
    assert list(parsed["b"].int64_list.value) == [1]
    assert list(parsed["l"].int64_list.value) == [1, 2]
    assert list(parsed["fl"].float_list.value) == [1.0, 2.0]
    assert list(parsed["s"].bytes_list.value) == [b"a", b"\x00\x01"]
    assert parsed["e"].WhichOneof("kind") is None


@pytest.mark.parametrize(("body", "message"), [
    (b'[]', "the body must be a JSON object"),
    (b'{"instances": []}', "unknown field 'instances' in the body; known: signature_name, context, examples"),
    (b'{}', "When method is classify, key 'examples' is expected and was not found"),
    (b'{"examples": {}}', "Expecting 'examples' value to be an list/array"),
    (b'{"examples": []}', "'examples' value is an empty array"),
    (b'{"examples": [1]}', "example 0: Example must be JSON object but got JSON number"),
    (b'{"examples": [{"x": [1.0, 2]}]}', None),
    (b'{"examples": [{"x": [1, 2.5]}]}', None),
    (b'{"examples": [{"x": [1, "a"]}]}', "example 0: Unexpected element type in feature: x expecting type: int64 "
                                        "(got a bytes value)"),
    (b'{"examples": [{"x": null}]}', "example 0: feature 'x' has an element of JSON type null"),
    (b'{"examples": [{"x": [[1]]}]}', "example 0: feature 'x' has an element of JSON type array"),
    (b'{"examples": [{"x": 18446744073709551615}]}', "example 0: feature 'x' has an integer out of int64's range"),
    (b'{"examples": [{"x": {"b64": "!"}}]}', "example 0: feature 'x': \"b64\" is not valid base64"),
    (b'{"examples": [{"x": "\\ud800"}]}', None),
    (b'{"context": {"x": 1}, "examples": [{"x": 2}]}',
     "example 0 and the context both have feature 'x'; give each feature in one of them only"),
])
def test_json_examples_refused_by_name(body: bytes, message: str | None) -> None:
    if message is None:
        tf_example_json.decode_body(body, "classify", {}, 1 << 20, 100)
        return
    with pytest.raises(InvalidInput) as caught:
        tf_example_json.decode_body(body, "classify", {}, 1 << 20, 100)
    assert str(caught.value).startswith(message), str(caught.value)


def servable(outputs: dict[str, TensorSpec], method: str, inputs: dict[str, TensorSpec] | None = None) -> Servable:
    inputs = inputs or {"inputs": TensorSpec(np.dtype(object), (None,))}
    signature = Signature("serving_default", inputs, outputs)
    definition = SignatureDefinition(method, {}, {})
    model = ModelInfo("m", 1, {"serving_default": signature}, {})
    return Servable("m", 1, "/m/1", predictor=Predictor(model, None),  # type: ignore[arg-type]
                    signature_defs={"serving_default": definition})


FLOAT2 = TensorSpec(np.dtype(np.float32), (None, 3))
STRING2 = TensorSpec(np.dtype(object), (None, 3))


@pytest.mark.parametrize(("outputs", "method", "inputs", "check", "message"), [
    ({"classes": STRING2, "scores": FLOAT2}, CLASSIFY, None, False, None),
    ({"scores": FLOAT2}, "tensorflow/serving/predict", None, False, None),
    ({"scores": FLOAT2}, "tensorflow/serving/predict", None, True,
     "signature 'serving_default' (method_name 'tensorflow/serving/predict') cannot classify: Expected classify "
     "signature method_name to be tensorflow/serving/classify (--signature-method-name-check)"),
    ({"y": FLOAT2}, CLASSIFY, {"x": FLOAT2}, False,
     "signature 'serving_default' (method_name 'tensorflow/serving/classify') cannot classify: a classify signature "
     "has exactly one input, 'inputs' (serialized tf.Examples); it has 'x'"),
    ({"y": FLOAT2}, CLASSIFY, None, False, "cannot classify: a classify signature returns 'classes', 'scores' or both "
                                           "and nothing else; it returns 'y'"),
    ({"scores": TensorSpec(np.dtype(np.float32), (None,))}, CLASSIFY, None, False,
     "cannot classify: its output 'scores' has shape [-1]; it must be [batch_size, num_classes]"),
    ({"scores": TensorSpec(np.dtype(np.float64), (None, 2))}, CLASSIFY, None, False,
     "cannot classify: its output 'scores' is DT_DOUBLE; it must be DT_FLOAT"),
    ({"inputs": FLOAT2}, CLASSIFY, {"inputs": FLOAT2}, False,
     "cannot classify: its input 'inputs' is DT_FLOAT [-1, 3], not a vector of serialized tf.Examples"),
])
def test_classify_signature_rules(outputs: dict[str, TensorSpec], method: str, inputs: dict[str, TensorSpec] | None,
                                  check: bool, message: str | None) -> None:
    methods = ExampleMethods(check)
    version = servable(outputs, method, inputs)
    if message is None:
        assert methods.signature(version, "", CLASSIFY).name == "serving_default"
        return
    with pytest.raises(InvalidInput) as caught:
        methods.signature(version, "", CLASSIFY)
    assert message in str(caught.value), str(caught.value)


def test_regress_signature_rules() -> None:
    methods = ExampleMethods()
    one = TensorSpec(np.dtype(np.float32), (None, 1))
    assert methods.signature(servable({"outputs": one}, REGRESS), "", REGRESS).name == "serving_default"
    with pytest.raises(InvalidInput, match="a regress signature returns one output, 'outputs'; it returns 'scores'"):
        methods.signature(servable({"scores": FLOAT2}, CLASSIFY), "", REGRESS)
    with pytest.raises(InvalidInput, match=r"'outputs' has shape \[-1, 1, 1\]; it must be \[batch_size\] or "
                                           r"\[batch_size, 1\]"):
        methods.signature(servable({"outputs": TensorSpec(np.dtype(np.float32), (None, 1, 1))}, REGRESS), "", REGRESS)


def inference(**outputs: np.ndarray) -> Inference:
    return Inference(servable({}, CLASSIFY), "serving_default", dict(outputs), 0.0, 0.0, 0.0, 0.0)


def test_outputs_follow_tf_serving_rules() -> None:
    labels = np.array([[b"a", b"b"]] * 2, dtype=object)
    check_classification(inference(classes=labels, scores=np.ones((2, 2), np.float32)), 2)
    with pytest.raises(InvalidInput, match=r"'scores' output has shape \[2\]: Expected Tensor shape"):
        check_classification(inference(scores=np.ones(2, np.float32)), 2)
    with pytest.raises(InvalidInput, match=r"Tensors class and score should match in dim_size\(1\). Got 2 vs. 3"):
        check_classification(inference(classes=labels, scores=np.ones((2, 3), np.float32)), 2)
    result = inference(outputs=np.ones((2, 1), np.float32))
    check_regression(result, 2)
    assert result.outputs["outputs"].shape == (2,)
    with pytest.raises(InvalidInput, match="Expected output Tensor shape to be either"):
        check_regression(inference(outputs=np.ones((2, 2), np.float32)), 2)


def test_json_results() -> None:
    scores = np.array([[0.25, 0.75]], np.float32)
    assert tf_example_json.classification_json({"classes": np.array([[b"a", b"\xff"]], dtype=object),
                                                "scores": scores}) == {"results": [[["a", 0.25], ["\ufffd", 0.75]]]}
    assert tf_example_json.classification_json({"scores": scores}) == {"results": [[["", 0.25], ["", 0.75]]]}
