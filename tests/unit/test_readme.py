"""The README documents every flag and every metric the server has (the user's guide must not
fall behind the code)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import REGISTRY

from server import metrics
from server.config import build_parser

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_flag_is_documented() -> None:
    flags = [option for action in build_parser()._actions for option in action.option_strings
             if option.startswith("--") and option != "--help" and "_" not in option]
    missing = [flag for flag in flags if f"`{flag}" not in README]
    assert not missing, f"flags missing from README.md: {missing}"


def test_every_metric_is_documented() -> None:
    assert metrics.REQUESTS is not None  # importing server.metrics registers them all
    names = {metric.name for metric in REGISTRY.collect() if metric.name.startswith("mirrorserve_")}
    assert len(names) >= 15
    missing = sorted(name for name in names
                     if f"`{name}" not in README and f"`{name}_total" not in README)
    assert not missing, f"metrics missing from README.md: {missing}"
