"""deploy/Dockerfile passes hadolint, runs as a non-root user, and its entrypoint is the server.

Building the image needs a container engine and network access to PyPI from inside the build;
`make image` does that where both exist. Here the Dockerfile itself is checked, and the
entrypoint is run as the image would run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.deploy.conftest import DEPLOY, ROOT, final_stage, image_entrypoint, image_env, tool


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
    assert image_entrypoint() == ["mirrorserve-entrypoint"]
    stage = final_stage()
    assert ("COPY", "deploy/entrypoint.sh /usr/local/bin/mirrorserve-entrypoint") in stage
    assert ("EXPOSE", "8500 8501") in stage and image_env()["MODEL_BASE_PATH"] == "/models"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["sh", str(DEPLOY / "entrypoint.sh"), "--help"], cwd=ROOT, capture_output=True,
                          text=True, check=False, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m server")
    assert "--grpc-max-connection-age-ms" in done.stdout


def entrypoint_arguments(tmp_path: Path, args: list[str], **env: str) -> list[str]:
    """What deploy/entrypoint.sh passes on to the server (a `python` that prints its arguments)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "python").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (fake / "python").chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MIRRORSERVE_")
             and k not in ("MODEL_NAME", "MODEL_BASE_PATH")}
    done = subprocess.run(["sh", str(DEPLOY / "entrypoint.sh"), *args], capture_output=True, text=True, check=True,
                          env={**clean, "PATH": f"{fake}{os.pathsep}{clean.get('PATH', '')}", **env}, timeout=30)
    return done.stdout.splitlines()


def test_the_entrypoint_follows_tf_servings_image_conventions(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / "model").mkdir(parents=True)
    # MODEL_NAME / MODEL_BASE_PATH as TF Serving's image uses them; extra arguments appended.
    assert entrypoint_arguments(tmp_path, ["--enable_batching=true"], MODEL_NAME="ranker", MODEL_BASE_PATH="/m") == [
        "-m", "server", "--model_name=ranker", "--model_base_path=/m/ranker", "--enable_batching=true"]
    # MODEL_NAME unset: "model" under MODEL_BASE_PATH, if that folder is there; else the demo model.
    assert entrypoint_arguments(tmp_path, [], MODEL_BASE_PATH=str(models)) == [
        "-m", "server", "--model_name=model", f"--model_base_path={models}/model"]
    assert entrypoint_arguments(tmp_path, [], MODEL_BASE_PATH=str(tmp_path / "none")) == ["-m", "server"]
    # Ours win: MIRRORSERVE_* or a model flag among the arguments.
    assert entrypoint_arguments(tmp_path, [], MODEL_NAME="ranker", MIRRORSERVE_MODEL_BASE_PATH="/x/y") == [
        "-m", "server"]
    assert entrypoint_arguments(tmp_path, ["--model_config_file=/c"], MODEL_NAME="ranker") == [
        "-m", "server", "--model_config_file=/c"]


def test_every_file_the_image_copies_is_in_the_build_context() -> None:
    """.dockerignore keeps deploy/ out of the context, but for the entry point the image copies."""
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    copied = [args.split()[0] for instruction, args in final_stage()
              if instruction == "COPY" and not args.startswith("--from")]
    assert copied == ["deploy/entrypoint.sh"]
    assert "deploy/" in ignored and "!deploy/entrypoint.sh" in ignored
    assert ignored.index("!deploy/entrypoint.sh") > ignored.index("deploy/")  # the later rule wins


def test_the_cpu_variant_installs_tensorflow_cpu() -> None:
    build = (DEPLOY / "Dockerfile").read_text()
    cpu = build[build.index("cpu) "):build.index("gpu) ")]
    assert '"tensorflow-cpu==2.21.*"' in cpu and "--no-deps ." in cpu
