"""Where the processes' metrics meet, with several front-ends: prometheus_client's multiprocess
mode. Kept apart from server.metrics because it must run before prometheus_client is imported
(the library picks its value storage at import, from PROMETHEUS_MULTIPROC_DIR)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

ENV = "PROMETHEUS_MULTIPROC_DIR"


def prepare() -> str:
    """Point every process of this server at one folder of metric files: the user's
    PROMETHEUS_MULTIPROC_DIR, emptied of an earlier run's files (as prometheus_client asks), or a
    fresh temporary folder removed at exit. Children inherit it through the environment."""
    existing = os.environ.get(ENV)
    if existing:
        Path(existing).mkdir(parents=True, exist_ok=True)
        for stale in Path(existing).glob("*.db"):
            stale.unlink(missing_ok=True)
        return existing
    folder = tempfile.mkdtemp(prefix="mirrorserve-metrics-")
    os.environ[ENV] = folder
    atexit.register(shutil.rmtree, folder, True)
    return folder
