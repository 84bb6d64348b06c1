"""The benchmark models, generated locally with fixed seeds (no download), from the cheapest per row
to the most expensive.

- mlp: 256 -> 1024 -> 1024 -> 10, overhead-bound: ~tens of microseconds of math per row, so what
  a server spends per request (gRPC, protobuf, Python) decides its throughput.
- dense: 512 -> 2048 -> 2048 -> 10, a wider fully connected net: its ~21 MB of weights are read on
  every call, so a batch costs milliseconds whatever its size, and rows add matrix products on top.
- attention: one transformer encoder block on 32 tokens of 64 features (two heads of scaled
  dot-product self-attention, a feed-forward layer, residuals and layer norms) and a classifier
  over the mean token: many small operations per call, the shape of a small sequence model.
- convnet: five 3x3 convolutions (32 to 128 channels) on 64x64x3 images: tens of milliseconds
  of math per 64-row batch, an image classifier of moderate cost.
- cnn: a small convolutional net on 96x96x3 images, compute-bound: the math decides.

Each is a tf.Module whose `serve` takes a batch of any size and returns {"logits": [rows, 10]}.
"""

from __future__ import annotations

import sys
from itertools import pairwise
from pathlib import Path

import numpy as np
import tensorflow as tf


def _he(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> tf.Variable:
    return tf.Variable(rng.normal(0, (2 / fan_in) ** 0.5, shape).astype(np.float32))


class MLP(tf.Module):
    SIZES = (256, 1024, 1024, 10)
    SEED = 1

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(self.SEED)
        self.weights = [_he(rng, (a, b), a) for a, b in pairwise(self.SIZES)]
        self.biases = [tf.Variable(np.zeros(b, np.float32)) for b in self.SIZES[1:]]

    def forward(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        h = x
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            h = tf.matmul(h, w) + b
            if i < len(self.weights) - 1:
                h = tf.nn.relu(h)
        return {"logits": h}

    @tf.function(input_signature=[tf.TensorSpec([None, 256], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return self.forward(x)


class Dense(MLP):
    SIZES = (512, 2048, 2048, 10)
    SEED = 3

    @tf.function(input_signature=[tf.TensorSpec([None, 512], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return self.forward(x)


def _layer_norm(h: tf.Tensor, gamma: tf.Variable, beta: tf.Variable) -> tf.Tensor:
    mean, variance = tf.nn.moments(h, axes=[-1], keepdims=True)
    return (h - mean) * tf.math.rsqrt(variance + 1e-5) * gamma + beta


class Attention(tf.Module):
    TOKENS, FEATURES, HEADS, HIDDEN = 32, 64, 2, 256

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(4)
        d, hidden = self.FEATURES, self.HIDDEN
        self.qkv = _he(rng, (d, 3 * d), d)
        self.project = _he(rng, (d, d), d)
        self.up, self.up_bias = _he(rng, (d, hidden), d), tf.Variable(np.zeros(hidden, np.float32))
        self.down, self.down_bias = _he(rng, (hidden, d), hidden), tf.Variable(np.zeros(d, np.float32))
        self.norms = [(tf.Variable(np.ones(d, np.float32)), tf.Variable(np.zeros(d, np.float32))) for _ in range(2)]
        self.classify = _he(rng, (d, 10), d)

    @tf.function(input_signature=[tf.TensorSpec([None, 32, 64], tf.float32, name="tokens")])
    def serve(self, tokens: tf.Tensor) -> dict[str, tf.Tensor]:
        rows = tf.shape(tokens)[0]
        t, d, heads = self.TOKENS, self.FEATURES, self.HEADS
        depth = d // heads
        qkv = tf.reshape(tf.matmul(tf.reshape(tokens, [-1, d]), self.qkv), [rows, t, 3, heads, depth])
        q, k, v = (tf.transpose(qkv[:, :, i], [0, 2, 1, 3]) for i in range(3))  # [rows, heads, t, depth]
        weights = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) * depth**-0.5, axis=-1)
        attended = tf.reshape(tf.transpose(tf.matmul(weights, v), [0, 2, 1, 3]), [-1, d])
        h = _layer_norm(tf.reshape(tokens, [-1, d]) + tf.matmul(attended, self.project), *self.norms[0])
        fed = tf.matmul(tf.nn.relu(tf.matmul(h, self.up) + self.up_bias), self.down) + self.down_bias
        h = _layer_norm(h + fed, *self.norms[1])
        pooled = tf.reduce_mean(tf.reshape(h, [rows, t, d]), axis=1)
        return {"logits": tf.matmul(pooled, self.classify)}


class ConvNet(tf.Module):
    # (input channels, output channels, stride) of each 3x3 convolution
    LAYERS = ((3, 32, 1), (32, 64, 2), (64, 128, 2), (128, 128, 1), (128, 128, 2))

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(5)
        self.kernels = [_he(rng, (3, 3, c, o), 9 * c) for c, o, _ in self.LAYERS]
        self.biases = [tf.Variable(np.zeros(o, np.float32)) for _, o, _ in self.LAYERS]
        self.dense = tf.Variable(rng.normal(0, 0.1, (128, 10)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 64, 64, 3], tf.float32, name="image")])
    def serve(self, image: tf.Tensor) -> dict[str, tf.Tensor]:
        h = image
        for kernel, bias, (_, _, stride) in zip(self.kernels, self.biases, self.LAYERS, strict=True):
            h = tf.nn.relu(tf.nn.conv2d(h, kernel, strides=stride, padding="SAME") + bias)
        pooled = tf.reduce_mean(h, axis=[1, 2])
        return {"logits": tf.matmul(pooled, self.dense)}


class CNN(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(2)
        shapes = [(3, 3, 3, 32), (3, 3, 32, 64), (3, 3, 64, 128), (3, 3, 128, 128)]
        self.kernels = [tf.Variable(rng.normal(0, (2 / (k * k * c)) ** 0.5, (k, k, c, o)).astype(np.float32))
                        for k, _, c, o in shapes]
        self.dense = tf.Variable(rng.normal(0, 0.1, (128, 10)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 96, 96, 3], tf.float32, name="image")])
    def serve(self, image: tf.Tensor) -> dict[str, tf.Tensor]:
        h = image
        for i, kernel in enumerate(self.kernels):
            h = tf.nn.relu(tf.nn.conv2d(h, kernel, strides=2 if i else 1, padding="SAME"))
        pooled = tf.reduce_mean(h, axis=[1, 2])
        return {"logits": tf.matmul(pooled, self.dense)}


BUILDERS: dict[str, type[tf.Module]] = {"mlp": MLP, "cnn": CNN, "dense": Dense, "attention": Attention,
                                        "convnet": ConvNet}


def build(name: str, base: Path) -> Path:
    """Write BASE/<name>/1/ once; return BASE/<name>."""
    target = base / name
    if not (target / "1" / "saved_model.pb").is_file():
        module = BUILDERS[name]()
        tf.saved_model.save(module, str(target / "1"), signatures={"serving_default": module.serve})
    return target


if __name__ == "__main__":
    for model in sys.argv[2:] or list(BUILDERS):
        print(build(model, Path(sys.argv[1])))
