"""Fixtures: test SavedModels on disk, and real server processes on free ports."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.launch import LISTENING, ROOT, SERVING, ServerProcess, start_server

__all__ = ["LISTENING", "ROOT", "SERVING", "ServerProcess", "start_server", "triton_client_path"]


def triton_client_path() -> str:
    """Where `make test` installed tritonclient (apart: see the Makefile)."""
    path = os.environ.get("TRITON_CLIENT_PATH") or str(ROOT / ".venv" / "tritonclient")
    if not (Path(path) / "tritonclient" / "grpc" / "__init__.py").is_file():
        pytest.fail(f"tritonclient not installed under {path}; run `make test`", pytrace=False)
    return path


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, Path]) -> Iterator[
        dict[tuple[str, ...], ServerProcess]]:
    """Server processes started on demand and shared within a test module, keyed by their
    arguments; stopped when the module ends, so idle servers do not pile up in memory."""
    started: dict[tuple[str, ...], ServerProcess] = {}
    yield started
    for server in started.values():  # all drain at once: each waits out its drain delay
        server.request_stop()
    for server in started.values():
        server.stop()


@pytest.fixture(scope="module")
def server_for(servers: dict[tuple[str, ...], ServerProcess], model_dirs: dict[str, Path],
               tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """server_for("echo", "--replicas", "3") -> a running server for that model and flags."""

    def get(model: str, *flags: str) -> ServerProcess:
        key = (model, *flags)
        if key not in servers:
            log_path = tmp_path_factory.mktemp("server") / "server.log"
            servers[key] = start_server(
                ["--model-base-path", str(model_dirs[model]), "--model-name", model, *flags], log_path
            )
        return servers[key]

    return get
