"""SavedModels built for the integration tests (not a test module; imported by conftest).

Each is tiny and deterministic, made to expose one property of the server:
- echo: returns its int64 rows unchanged, so a test can see whose rows came back, in what order.
- multi: two float/int inputs, a second signature, and a string signature: input validation.
"""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf


class Echo(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.int64, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"y": tf.identity(x), "first": x[:, 0] + 0}


class Multi(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = tf.Variable([1.0, 2.0, 3.0], name="scale")

    @tf.function(input_signature=[
        tf.TensorSpec([None, 3], tf.float32, name="a"),
        tf.TensorSpec([None], tf.int32, name="b"),
    ])
    def serve(self, a: tf.Tensor, b: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"c": a * self.scale * tf.cast(b, tf.float32)[:, None], "b_twice": b * 2}

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="a")])
    def total(self, a: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"total": tf.reduce_sum(a, axis=1)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="s")])
    def strlen(self, s: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"n": tf.strings.length(s), "upper": tf.strings.upper(s)}


def build_echo(version_dir: Path) -> None:
    module = Echo()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve})


def build_multi(version_dir: Path) -> None:
    module = Multi()
    tf.saved_model.save(module, str(version_dir), signatures={
        "serving_default": module.serve, "total": module.total, "strlen": module.strlen,
    })
