"""SavedModels built for the integration tests (not a test module; imported by conftest).

Each is tiny and deterministic, made to expose one property of the server:
- echo: returns its int64 rows unchanged, so a test can see whose rows came back, in what order.
- multi: two float/int inputs, a second signature, and a string signature: input validation.
- logic: boolean inputs and outputs.
- tagged: answers with its own version number: which version served a request (lifecycle).
- batch_rows: answers each row with the number of rows of the batch it ran in (padding, splits).
- convolution: images of any size, XLA-compiled per shape on first use (warmup files).
- positive_only: asserts its inputs are positive, so it refuses the zeros of the generated warm-up.
- typed: one output of each dtype a client reads from its own typed field (float32, float16,
  int64, bool, string, complex64), for answers read the way TF Serving's example clients read them.
- detector: the Object Detection API's input, uint8 [1, -1, -1, 3], and outputs without a batch
  dimension (a size vector, a scalar); a second signature takes a scalar. Served unbatched.
- rolling: a version that says its number on every protocol: Predict on 512 features (so REST
  bodies of 64 rows go to the body decoder's helper process) and Classify of tf.Examples.
- checked: asserts its inputs are positive and gathers from a 3-entry table by an index it is
  sent: TensorFlow's own errors (InvalidArgumentError) on bad rows.
- hang: doubles its input, but a positive input starts a tf.while_loop of 2**62 steps, a batch
  that does not return for centuries (the worker watchdog's test).
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


class Slow(tf.Module):
    """Costs what the request asks, and fails on a poisoned row.

    x[:, 0] is work: the batch runs max(x[:, 0]) iterations of a 128x128 matmul (so one slow row
    makes its whole batch slow); x[:, 1] is the value, and y = 2 * value (NaN and Inf included).
    A row whose value is -1 makes the batch fail inside the model (tf.debugging.Assert).
    """

    def __init__(self) -> None:
        super().__init__()
        self.w = tf.Variable(tf.eye(128) * 0.5 + 0.01, name="w")

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        tf.debugging.Assert(tf.reduce_all(tf.not_equal(x[:, 1], -1.0)), ["poisoned row (value -1) in the batch"])
        iterations = tf.cast(tf.reduce_max(tf.concat([x[:, 0], [0.0]], axis=0)), tf.int32)
        _, work = tf.while_loop(
            lambda i, m: i < iterations,
            lambda i, m: (i + 1, tf.tanh(tf.matmul(m, self.w))),
            (tf.constant(0), tf.eye(128)),
        )
        with tf.control_dependencies([work]):
            return {"y": tf.identity(x[:, 1] * 2.0)}


def build_slow(version_dir: Path) -> None:
    module = Slow()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve})


class Tagged(tf.Module):
    """Answers y = x + version and the version itself, so a response shows which version computed
    it. Holds a 4 MB variable, so a version that is not freed on unload shows in memory."""

    def __init__(self, version: int) -> None:
        super().__init__()
        self.offset = tf.Variable(float(version), name="offset")
        self.version = tf.Variable(version, dtype=tf.int64, name="version")
        self.weights = tf.Variable(tf.zeros([1024, 1024]), name="weights")

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        rows = tf.shape(x)[0]
        return {"y": x + self.offset + self.weights[0, 0], "version": tf.fill([rows], self.version)}


def build_tagged(version_dir: Path, version: int) -> None:
    """A model of the tagged family, saved as `version`."""
    module = Tagged(version)
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve})


class Logic(tf.Module):
    """Boolean rows: whether any and whether all of a row's three flags are set, and how many.
    A second signature, `halve`, takes and returns bfloat16."""

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.bool, name="flags")])
    def serve(self, flags: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"any": tf.reduce_any(flags, axis=1), "all": tf.reduce_all(flags, axis=1),
                "count": tf.reduce_sum(tf.cast(flags, tf.int64), axis=1)}


    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.bfloat16, name="h")])
    def halve(self, h: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"half": h / tf.constant(2, tf.bfloat16)}


def build_logic(version_dir: Path) -> None:
    module = Logic()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve,
                                                              "halve": module.halve})


class BatchRows(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None, 1], tf.int64, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        rows = tf.shape(x, out_type=tf.int64)[0]
        return {"x": x, "batch_rows": tf.fill(tf.shape(x)[:1], rows)}


def build_batch_rows(version_dir: Path) -> None:
    module = BatchRows()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve})


class Convolution(tf.Module):
    """Two 3x3 convolutions over images of any size, pooled to 16 features per image, compiled by
    XLA (jit_compile): its first call at each new shape compiles for that shape, the kind of cost
    a warmup file exists to take off the first real request. The worker's own warm-up runs 1x1
    images, so only a warmup file of the real size covers it."""

    def __init__(self) -> None:
        super().__init__()
        rng = tf.random.Generator.from_seed(7)
        self.k1 = tf.Variable(rng.normal([3, 3, 3, 16]) * 0.1, name="k1")
        self.k2 = tf.Variable(rng.normal([3, 3, 16, 16]) * 0.1, name="k2")

    @tf.function(input_signature=[tf.TensorSpec([None, None, None, 3], tf.float32, name="image")],
                 jit_compile=True)
    def serve(self, image: tf.Tensor) -> dict[str, tf.Tensor]:
        h = tf.nn.relu(tf.nn.conv2d(image, self.k1, 1, "SAME"))
        h = tf.nn.relu(tf.nn.conv2d(h, self.k2, 1, "SAME"))
        return {"features": tf.reduce_mean(h, axis=[1, 2])}


def build_convolution(version_dir: Path) -> None:
    module = Convolution()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve})


class PositiveOnly(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        with tf.control_dependencies([tf.debugging.assert_positive(x, message="inputs must be positive")]):
            return {"log": tf.math.log(x)}


def build_positive_only(version_dir: Path) -> None:
    module = PositiveOnly()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve})


class Checked(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = tf.Variable([10.0, 20.0, 30.0], name="table")

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x"),
                                  tf.TensorSpec([None], tf.int64, name="index")])
    def serve(self, x: tf.Tensor, index: tf.Tensor) -> dict[str, tf.Tensor]:
        with tf.control_dependencies([tf.debugging.assert_positive(x, message="inputs must be positive")]):
            return {"y": tf.reduce_sum(x, axis=1) + tf.gather(self.table, index)}


def build_checked(version_dir: Path) -> None:
    module = Checked()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve})


class Typed(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"scores": x * 2.5, "half": tf.cast(x / 3, tf.float16), "count": tf.cast(tf.round(x * 10), tf.int64),
                "positive": x > 0, "label": tf.strings.as_string(x[:, 0], precision=2),
                "phase": tf.complex(x[:, 0], x[:, 1])}


def build_typed(version_dir: Path) -> None:
    module = Typed()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve})


class Detector(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([1, None, None, 3], tf.uint8, name="images")])
    def detect(self, images: tf.Tensor) -> dict[str, tf.Tensor]:
        pixels = tf.cast(images, tf.float32)
        return {"mean_color": tf.reduce_mean(pixels, axis=[1, 2]), "size": tf.shape(images)[1:3],
                "brightest": tf.reduce_max(pixels)}

    @tf.function(input_signature=[tf.TensorSpec([], tf.float32, name="factor")])
    def scale(self, factor: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"twice": factor * 2.0}


def build_detector(version_dir: Path) -> None:
    module = Detector()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.detect, "scale": module.scale})


class Rolling(tf.Module):
    FEATURES = 512

    def __init__(self, version: int) -> None:
        super().__init__()
        self.version = tf.Variable(version, dtype=tf.int64, name="version")

    @tf.function(input_signature=[tf.TensorSpec([None, FEATURES], tf.float32, name="x")])
    def predict(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"total": tf.reduce_sum(x, axis=1), "version": tf.fill([tf.shape(x)[0]], self.version)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def classify(self, inputs: tf.Tensor) -> dict[str, tf.Tensor]:
        parsed = tf.io.parse_example(inputs, {"x": tf.io.FixedLenFeature([1], tf.float32)})
        return {"scores": tf.concat([parsed["x"], tf.cast(tf.fill([tf.shape(inputs)[0], 1], self.version),
                                                            tf.float32)], axis=1)}


def build_rolling(version_dir: Path, version: int) -> None:
    module = Rolling(version)
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.predict,
                                                             "classify": module.classify})


class Hang(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None, 1], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        steps = tf.cast(tf.reduce_max(x) > 0, tf.int64) * (1 << 62)
        (done,) = tf.while_loop(lambda i: i < steps, lambda i: (i + 1,), (tf.constant(0, tf.int64),))
        return {"y": x * 2 + tf.cast(done, tf.float32) * 0}


def build_hang(version_dir: Path) -> None:
    module = Hang()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve})
