"""deploy/Dockerfile passes hadolint, runs as a non-root user, and its entrypoint is the server.

Building the image needs a container engine and network access to PyPI from inside the build;
`make image` does that where both exist. Here the Dockerfile itself is checked, and the
entrypoint is run as the image would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.deploy.conftest import DEPLOY, ROOT, final_stage, image_entrypoint, tool


def hadolint(dockerfile: Path) -> subprocess.CompletedProcess[str]:
    """hadolint failing on every finding, info level included."""
    return subprocess.run([tool("hadolint"), "--no-color", "--failure-threshold", "info", str(dockerfile)],
                          capture_output=True, text=True, check=False)


def test_hadolint_passes() -> None:
    done = hadolint(DEPLOY / "Dockerfile")
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_is_not_a_no_op(tmp_path: Path) -> None:
    """The same run refuses a Dockerfile that ends as root with an unpinned apt install."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN apt-get install curl\nUSER root\n")
    done = hadolint(bad)
    assert done.returncode != 0
    assert "DL3002" in done.stdout  # last USER should not be root


def test_image_runs_as_non_root_user() -> None:
    stage = final_stage()
    users = [args for instruction, args in stage if instruction == "USER"]
    assert users, "the final stage sets no USER (it would run as root)"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric, so runAsNonRoot can verify it"
    assert gid.isdigit() and int(gid) != 0
    # The user exists in the image, created in the same stage.
    assert any(instruction == "RUN" and f"--uid {uid}" in args for instruction, args in stage)
    # No compilers or build tools are installed in the final stage; it copies the built venv.
    assert not any(instruction == "RUN" and ("apt-get" in args or "pip install" in args) for instruction, args in stage)
    assert any(instruction == "COPY" and args.startswith("--from=build") for instruction, args in stage)


def test_entrypoint_is_the_server() -> None:
    entrypoint = image_entrypoint()
    assert entrypoint == ["python", "-m", "server"]
    done = subprocess.run([sys.executable, *entrypoint[1:], "--help"], cwd=ROOT, capture_output=True,
                          text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m server")
    assert "--grpc-max-connection-age-ms" in done.stdout
