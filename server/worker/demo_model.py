"""The built-in demo model, so `python -m server` serves something with no download.

A small deterministic MLP (8 features -> 16 hidden -> 3 classes) with fixed-seed weights, built
once into a cache folder and reused. The build writes to a temporary folder and renames it into
place, so concurrent first starts cannot see a half-written model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensorflow as tf

DEMO_NAME = "demo"
DEMO_REVISION = 1
"""Bump when build_demo_model changes, so old caches are not served."""


def cache_dir() -> Path:
    root = os.environ.get("MIRRORSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mirrorserve"
    )
    return Path(root)


class _DemoMLP(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(20261202)
        self.w1 = tf.Variable(rng.normal(0, 0.5, (8, 16)).astype(np.float32), name="w1")
        self.b1 = tf.Variable(rng.normal(0, 0.1, (16,)).astype(np.float32), name="b1")
        self.w2 = tf.Variable(rng.normal(0, 0.5, (16, 3)).astype(np.float32), name="w2")
        self.b2 = tf.Variable(rng.normal(0, 0.1, (3,)).astype(np.float32), name="b2")

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        hidden = tf.nn.relu(tf.matmul(x, self.w1) + self.b1)
        logits = tf.matmul(hidden, self.w2) + self.b2
        return {
            "probabilities": tf.nn.softmax(logits),
            "class_id": tf.argmax(logits, axis=1, output_type=tf.int64),
        }


def build_demo_model(version_dir: Path) -> None:
    module = _DemoMLP()
    tf.saved_model.save(module, str(version_dir), signatures={"serving_default": module.serve})


def ensure_demo_model() -> Path:
    """The demo model's base path (BASE/1/saved_model.pb), building it on first use."""
    return ensure_built(f"{DEMO_NAME}-r{DEMO_REVISION}", lambda staging: build_demo_model(staging / "1"))


def ensure_built(name: str, build: Callable[[Path], None]) -> Path:
    """cache_dir()/name, which `build` fills on first use (given an empty folder to fill). The
    folder is built apart and renamed into place whole, so it exists only complete, and
    concurrent first uses cannot see a half-written one."""
    base = cache_dir() / name
    if base.is_dir():
        return base
    base.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=base.parent))
    try:
        build(staging)
        try:
            staging.rename(base)
        except OSError:
            if not base.is_dir():
                raise  # the rename failed for another reason than a concurrent build winning
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return base
