"""The model zoo of the replica path (not a test module): small models of the families users serve,
built with TensorFlow's own (Keras) layers, random weights, fixed seeds, no download. Exported
once into the cache folder the demo model uses, and reused by later runs.

- convbn: Conv2D, BatchNormalization (moving statistics made non-trivial), ReLU6, a depthwise
  convolution, global pooling: a MobileNet-style image classifier. Its convolution and batch-norm
  kernels are the ones oneDNN refused zero-row tensors for on some CPUs (issue 40).
- rnn: a GRU over a sequence feeding an LSTM, then a dense layer.
- transformer: multi-head self-attention and a feed-forward layer, each with a residual and
  LayerNormalization, mean-pooled into a classifier.
- mixed: integer and string inputs (a Hashing layer and two Embeddings), with a float, a string
  and an integer output.
- no_empty_batch: asserts that its batch is not empty, as those kernels do on the CPUs where they
  refuse empty inputs: it shows on any CPU whether a replica was ever given zero rows.

Each model's `serving_default` takes a batch of any size; ZOO lists its inputs for the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ZOO_REVISION = 1
"""Bump when a model here changes, so old caches are not served."""


@dataclass(frozen=True)
class ZooModel:
    name: str
    tolerance: float
    """Largest difference allowed between served and in-process float outputs, relative to the
    output's largest value: float32 kernels may sum in another order at another batch size (a
    convolution most), so rows run in a batch of 7 differ in the last bits from the same rows alone."""
    rows: Callable[[np.random.Generator, int], dict[str, np.ndarray]]
    """`rows` rows of inputs a client would send."""


def _floats(name: str, shape: tuple[int, ...]) -> Callable[[np.random.Generator, int], dict[str, np.ndarray]]:
    return lambda rng, rows: {name: rng.standard_normal((rows, *shape)).astype(np.float32)}


def _mixed_rows(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    words = np.array([f"word-{rng.integers(1000)}".encode() for _ in range(rows)], dtype=object)
    return {"ids": rng.integers(0, 50, (rows, 3)).astype(np.int64), "words": words}


IMAGE, SEQUENCE, TOKENS = (16, 16, 3), (6, 4), (8, 16)
ZOO = {
    "convbn": ZooModel("convbn", 1e-4, _floats("image", IMAGE)),
    "rnn": ZooModel("rnn", 1e-5, _floats("sequence", SEQUENCE)),
    "transformer": ZooModel("transformer", 1e-5, _floats("tokens", TOKENS)),
    "mixed": ZooModel("mixed", 1e-6, _mixed_rows),
    "no_empty_batch": ZooModel("no_empty_batch", 0.0, _floats("x", (4,))),
}


def ensure_zoo() -> dict[str, Path]:
    """Each zoo model's base path (BASE/1/saved_model.pb), built on first use."""
    from server.worker.demo_model import ensure_built

    root = ensure_built(f"test-zoo-r{ZOO_REVISION}", build_zoo)
    return {name: root / name for name in ZOO}


def build_zoo(root: Path) -> None:
    import keras
    import tensorflow as tf
    from keras import layers

    keras.utils.set_random_seed(40)

    def export(name: str, module: tf.Module) -> None:
        tf.saved_model.save(module, str(root / name / "1"), signatures={"serving_default": module.serve})

    class Wrapped(tf.Module):
        """A Keras model behind a signature of named inputs and outputs, as TF Serving users export."""

        def __init__(self, model: keras.Model, spec: tf.TensorSpec, output: str) -> None:
            super().__init__()
            self.model = model
            self.output = output
            self.serve = tf.function(self._serve, input_signature=[spec])

        def _serve(self, batch: tf.Tensor) -> dict[str, tf.Tensor]:
            return {self.output: self.model(batch, training=False)}

    # convbn
    image = keras.Input(IMAGE)
    h = layers.ReLU(6.0)(layers.BatchNormalization()(layers.Conv2D(8, 3, padding="same", use_bias=False)(image)))
    h = layers.DepthwiseConv2D(3, strides=2, padding="same", use_bias=False)(h)
    h = layers.ReLU(6.0)(layers.BatchNormalization()(h))
    h = layers.BatchNormalization()(layers.Conv2D(16, 1, use_bias=False)(h))
    convbn = keras.Model(image, layers.Dense(5)(layers.GlobalAveragePooling2D()(h)))
    rng = np.random.default_rng(41)
    for layer in convbn.layers:
        if isinstance(layer, layers.BatchNormalization):  # trained-looking statistics, not 0 and 1
            size = layer.moving_mean.shape[0]
            layer.moving_mean.assign(rng.normal(0, 0.5, size).astype(np.float32))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, size).astype(np.float32))
    export("convbn", Wrapped(convbn, tf.TensorSpec([None, *IMAGE], tf.float32, name="image"), "logits"))

    # rnn
    sequence = keras.Input(SEQUENCE)
    h = layers.LSTM(8)(layers.GRU(8, return_sequences=True)(sequence))
    rnn = keras.Model(sequence, layers.Dense(3)(h))
    export("rnn", Wrapped(rnn, tf.TensorSpec([None, *SEQUENCE], tf.float32, name="sequence"), "scores"))

    # transformer
    tokens = keras.Input(TOKENS)
    attended = layers.MultiHeadAttention(num_heads=2, key_dim=8)(tokens, tokens)
    h = layers.LayerNormalization()(tokens + attended)
    fed = layers.Dense(TOKENS[1])(layers.Dense(32, activation="relu")(h))
    h = layers.LayerNormalization()(h + fed)
    transformer = keras.Model(tokens, layers.Dense(4)(layers.GlobalAveragePooling1D()(h)))
    export("transformer", Wrapped(transformer, tf.TensorSpec([None, *TOKENS], tf.float32, name="tokens"), "logits"))

    class Mixed(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hash = layers.Hashing(num_bins=32)
            self.word_vectors = layers.Embedding(32, 4)
            self.id_vectors = layers.Embedding(50, 4)
            self.dense = layers.Dense(3)

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.int64, name="ids"),
                                      tf.TensorSpec([None], tf.string, name="words")])
        def serve(self, ids: tf.Tensor, words: tf.Tensor) -> dict[str, tf.Tensor]:
            vectors = tf.concat([tf.reshape(self.id_vectors(ids), [-1, 12]), self.word_vectors(self.hash(words))], 1)
            return {"scores": self.dense(vectors), "shout": tf.strings.upper(words), "next_ids": ids + 1}

    export("mixed", Mixed())

    class NoEmptyBatch(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
        def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
            rows = tf.shape(x)[0]
            check = tf.debugging.assert_positive(rows, message="this kernel refuses an empty batch")
            with tf.control_dependencies([check]):
                return {"y": x * 2.0 + 1.0}

    export("no_empty_batch", NoEmptyBatch())
