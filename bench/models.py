"""The two benchmark models, generated locally with fixed seeds (no download).

- mlp: 256 -> 1024 -> 1024 -> 10, overhead-bound: ~tens of microseconds of math per row, so what
  a server spends per request (gRPC, protobuf, Python) decides its throughput.
- cnn: a small convolutional net on 96x96x3 images, compute-bound: the math decides.
"""

from __future__ import annotations

import sys
from itertools import pairwise
from pathlib import Path

import numpy as np
import tensorflow as tf


class MLP(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(1)
        sizes = [256, 1024, 1024, 10]
        self.weights = [tf.Variable(rng.normal(0, (2 / a) ** 0.5, (a, b)).astype(np.float32))
                        for a, b in pairwise(sizes)]
        self.biases = [tf.Variable(np.zeros(b, np.float32)) for b in sizes[1:]]

    @tf.function(input_signature=[tf.TensorSpec([None, 256], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        h = x
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            h = tf.matmul(h, w) + b
            if i < len(self.weights) - 1:
                h = tf.nn.relu(h)
        return {"logits": h}


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


BUILDERS: dict[str, type[MLP] | type[CNN]] = {"mlp": MLP, "cnn": CNN}


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
