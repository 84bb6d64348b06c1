"""SavedModels that take serialized tf.Examples, exported as TF Serving's users export them: a
TF1 graph, TensorFlow's own classification_signature_def / regression_signature_def, and
tf.io.parse_example reading the features (not a test module).

- classifier: "serving_default" classifies (classes and scores, 3 classes), "regress" regresses
  ([batch, 1]), "predict" is a predict signature taking a float "x", and "bad_scores" returns
  scores of shape [batch] (which TF Serving's rules refuse).
- scorer: "serving_default" classifies with scores only.
- regressor: "serving_default" regresses ([batch]).
- native: a TF2 export (tf.saved_model.save of a tf.function), whose signature's method_name is
  predict, as TF2 writes every signature, but whose input and output are a classifier's.

Features: "x" (2 floats, required), "age" (1 int64, default 30), "tags" (any number of strings).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

LABELS = ("cat", "dog", "bird")
WEIGHTS = [[1.0, -1.0, 0.5], [0.5, 2.0, -1.0]]


def _spec() -> dict[str, Any]:
    return {"x": tf.io.FixedLenFeature([2], tf.float32),
            "age": tf.io.FixedLenFeature([1], tf.int64, default_value=[30]),
            "tags": tf.io.VarLenFeature(tf.string)}


def _logits(serialized: tf.Tensor) -> tf.Tensor:
    features = tf.io.parse_example(serialized, _spec())
    tags = tf.sparse.to_dense(features["tags"], default_value="")
    tag_count = tf.reduce_sum(tf.cast(tf.not_equal(tags, ""), tf.float32), axis=1, keepdims=True)
    age = tf.cast(features["age"], tf.float32)
    return tf.matmul(features["x"], tf.constant(WEIGHTS)) + age * 0.01 + tag_count * tf.constant([0.1, 0.0, -0.1])


def _export(version_dir: Path, signatures: Any) -> None:
    shutil.rmtree(version_dir, ignore_errors=True)
    graph = tf.Graph()
    with graph.as_default():
        serialized = tf.compat.v1.placeholder(tf.string, [None], name="tf_example")
        signature_defs = signatures(serialized)
        with tf.compat.v1.Session(graph=graph) as session:
            builder = tf.compat.v1.saved_model.Builder(str(version_dir))
            builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map=signature_defs)
            builder.save()


def build_classifier(version_dir: Path) -> None:
    def signatures(serialized: tf.Tensor) -> dict[str, Any]:
        logits = _logits(serialized)
        scores = tf.nn.softmax(logits)
        classes = tf.tile(tf.constant([list(LABELS)]), [tf.shape(scores)[0], 1])
        x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
        return {
            "serving_default": tf.compat.v1.saved_model.classification_signature_def(serialized, classes, scores),
            "regress": tf.compat.v1.saved_model.regression_signature_def(
                serialized, tf.reduce_sum(logits, axis=1, keepdims=True)),
            "predict": tf.compat.v1.saved_model.predict_signature_def({"x": x}, {"y": tf.matmul(x, WEIGHTS)}),
            "bad_scores": tf.compat.v1.saved_model.classification_signature_def(
                serialized, None, tf.reduce_sum(scores, axis=1)),
        }

    _export(version_dir, signatures)


def build_scorer(version_dir: Path) -> None:
    _export(version_dir, lambda serialized: {"serving_default": tf.compat.v1.saved_model.classification_signature_def(
        serialized, None, tf.nn.sigmoid(_logits(serialized)))})


def build_regressor(version_dir: Path) -> None:
    _export(version_dir, lambda serialized: {"serving_default": tf.compat.v1.saved_model.regression_signature_def(
        serialized, tf.reduce_sum(_logits(serialized), axis=1) * 2.0)})


class Native(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def serve(self, inputs: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"scores": tf.nn.softmax(_logits(inputs))}


def build_native(version_dir: Path) -> None:
    module = Native()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve})


def example(x: Sequence[float] | None = None, age: int | None = None, tags: Sequence[str] | None = None) -> Any:
    """A tf.train.Example with the features given."""
    built = tf.train.Example()
    features = built.features.feature
    if x is not None:
        features["x"].float_list.value.extend(x)
    if age is not None:
        features["age"].int64_list.value.append(age)
    if tags is not None:
        features["tags"].bytes_list.value.extend(t.encode() for t in tags)
    return built


def random_examples(rng: random.Random, count: int, context: bool = False) -> list[bytes]:
    """Serialized examples with random features; with `context`, only "x" (the context has the rest)."""
    return [example([round(rng.uniform(-2, 2), 3), round(rng.uniform(-2, 2), 3)],
                    None if context or rng.random() < 0.3 else rng.randrange(0, 90),
                    None if context else [f"t{i}" for i in range(rng.randrange(0, 4))]).SerializeToString()
            for _ in range(count)]


def merged(examples: Sequence[bytes], context: bytes | None) -> list[bytes]:
    """Each example with the context's features, merged as messages (not as bytes)."""
    if not context:
        return list(examples)
    out = []
    for raw in examples:
        combined = tf.train.Example.FromString(context)
        combined.MergeFrom(tf.train.Example.FromString(raw))
        out.append(combined.SerializeToString())
    return out


def reference(model_dir: Path, signature: str, examples: Sequence[bytes], context: bytes | None = None
              ) -> Mapping[str, np.ndarray]:
    """The signature called in-process on the examples: TF Serving's answer, as arrays."""
    function = tf.saved_model.load(str(model_dir)).signatures[signature]
    outputs = function(inputs=tf.constant(merged(examples, context)))
    return {name: tensor.numpy() for name, tensor in outputs.items()}
