"""The line between the two processes, checked in fresh interpreters:
- the protocol (serving) process never imports TensorFlow;
- the model worker never imports the generated protos or the protocol front-ends.
And our copies of TensorFlow's protos (protos/tf) load beside TensorFlow's own, in either order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _modules_after(imports: str) -> set[str]:
    """sys.modules of a fresh interpreter after `imports`."""
    code = f"import sys\n{imports}\nprint('\\n'.join(sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    return set(done.stdout.split())


def test_the_serving_process_never_imports_tensorflow() -> None:
    modules = _modules_after("import server.main")
    assert "server.api.tfserving.grpc_service" in modules  # the front-ends did load
    assert not {m for m in modules if m == "tensorflow" or m.startswith("tensorflow.")}
    assert not {m for m in modules if m.startswith("server.worker")}


def test_a_front_end_process_never_imports_tensorflow() -> None:
    modules = _modules_after("import server.frontends.secondary, server.frontends.fleet")
    assert "server.api.tfserving.grpc_service" in modules and "server.frontends.follower" in modules
    assert not {m for m in modules if m == "tensorflow" or m.startswith("tensorflow.")}
    assert not {m for m in modules if m.startswith("server.worker")}


def test_the_model_worker_never_imports_generated_protos() -> None:
    modules = _modules_after("import server.core.model_process, server.worker.loop, server.worker.saved_model, "
                             "server.worker.replicas, server.worker.demo_model")
    assert "tensorflow" in modules  # the worker's modules did load
    assert not {m for m in modules if m == "protos" or m.startswith("protos.")}
    assert not {m for m in modules if m.startswith("server.api") or m == "server.api.tensor_codec"}


@pytest.mark.parametrize("first", ["ours", "tensorflow's"])
def test_our_tensorflow_protos_load_beside_tensorflows_own(first: str) -> None:
    """One descriptor pool accepts a file twice only when both copies are identical (protos/build.py)."""
    ours = "from protos.tf.tensorflow.core.framework import tensor_pb2 as ours\n" \
           "from protos.tensorflow_serving import get_model_metadata_pb2, predict_pb2, status_pb2"
    theirs = "from tensorflow.core.framework import tensor_pb2 as theirs\n" \
             "from tensorflow.core.protobuf import meta_graph_pb2, error_codes_pb2"
    both = f"{ours}\n{theirs}" if first == "ours" else f"{theirs}\n{ours}"
    modules = _modules_after(f"{both}\nassert ours.TensorProto is theirs.TensorProto")
    assert "tensorflow.core.framework.tensor_pb2" in modules
