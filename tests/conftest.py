"""Shared test settings and the test SavedModels every server-starting test serves."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# Keep TensorFlow's C++ start-up chatter out of test output.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Base paths (BASE/<version>/) of every model the tests serve."""
    from server.worker.demo_model import build_demo_model
    from tests.integration.saved_models import (
        build_batch_rows,
        build_checked,
        build_detector,
        build_echo,
        build_logic,
        build_multi,
        build_slow,
        build_typed,
    )

    root = tmp_path_factory.mktemp("models")
    build_demo_model(root / "demo" / "1")
    build_echo(root / "echo" / "1")
    build_multi(root / "multi" / "1")
    build_slow(root / "slow" / "1")
    build_logic(root / "logic" / "1")
    build_batch_rows(root / "batch_rows" / "1")
    build_checked(root / "checked" / "1")
    build_typed(root / "typed" / "1")
    build_detector(root / "detector" / "1")
    # Several versions: the highest numeric one (3) must be served; junk folders are ignored.
    shutil.copytree(root / "echo" / "1", root / "versioned" / "1")
    shutil.copytree(root / "echo" / "1", root / "versioned" / "3")
    (root / "versioned" / "10-not-a-version").mkdir()
    (root / "versioned" / "7").mkdir()  # no saved_model.pb: not a version
    return {p.name: p for p in root.iterdir()}

