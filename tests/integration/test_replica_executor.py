"""Which TensorFlow executor a signature's program runs on (server.worker.replicas), in-process on
real SavedModels: the single-threaded one where it runs the graph, the default one where it
refuses it, and the same answers either way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from server.errors import ModelError
from server.worker import replicas
from server.worker import saved_model as model

LOADED: list[model.LoadedModel] = []
"""The models loaded here, kept alive as the server keeps them (their variables go with them)."""


def runner_for(base: Path) -> replicas.SignatureRunner:
    strategy = replicas.make_strategy(["/device:CPU:0"])
    loaded = model.load(base / "1", base.name, 1, strategy)
    LOADED.append(loaded)
    return replicas.SignatureRunner(strategy, loaded.functions["serving_default"],
                                    loaded.info.signatures["serving_default"])


def test_a_plain_graph_runs_on_the_single_threaded_executor(model_dirs: dict[str, Path]) -> None:
    runner = runner_for(model_dirs["echo"])
    runner.warm_up([1, 4])
    assert runner.executor == replicas.SINGLE_THREADED
    rows = np.arange(10, dtype=np.int64).reshape(5, 2)
    outputs = runner({"x": rows})
    np.testing.assert_array_equal(outputs["y"], rows)
    np.testing.assert_array_equal(outputs["first"], rows[:, 0])


def test_a_graph_the_single_threaded_executor_refuses_falls_back_to_the_default(
        model_dirs: dict[str, Path]) -> None:
    # The slow model loops with tf.while_loop, which TensorFlow lowers to Switch/Merge nodes: the
    # single-threaded executor refuses them when the program is first called.
    runner = runner_for(model_dirs["slow"])
    assert runner.executor == replicas.SINGLE_THREADED  # until its first call says otherwise
    with tf.experimental.function_executor_type(replicas.SINGLE_THREADED), \
            pytest.raises(tf.errors.OpError, match=r"(?i)single-threaded executor"):
        runner._trace(replicas.SINGLE_THREADED, 1)([{"x": tf.constant([[1.0, 2.0]])}])
    runner.warm_up([1, 2])
    assert runner.executor == replicas.DEFAULT_EXECUTOR
    outputs = runner({"x": np.array([[3.0, 1.5], [0.0, -4.0]], np.float32)})
    np.testing.assert_array_equal(outputs["y"], np.array([3.0, -8.0], np.float32))


def test_a_model_failure_on_the_default_executor_still_fails_as_the_model(model_dirs: dict[str, Path]) -> None:
    runner = runner_for(model_dirs["slow"])
    runner.warm_up([1])
    with pytest.raises(ModelError, match="poisoned row"):  # value -1: the model's own Assert
        runner({"x": np.array([[0.0, -1.0]], np.float32)})
