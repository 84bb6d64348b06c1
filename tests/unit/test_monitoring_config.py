"""--monitoring_config_file as TF Serving reads it: where the metrics are served, if at all, and a
clear error at start for a file that is not a MonitoringConfig."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.frontends.monitoring_config import DEFAULT_PATHS, metrics_paths


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "monitoring.config"
    path.write_text(text)
    return str(path)


def test_without_a_file_the_servers_own_paths() -> None:
    assert metrics_paths(None) == DEFAULT_PATHS == ("/metrics", "/monitoring/prometheus/metrics")


@pytest.mark.parametrize(("text", "paths"), [
    ('prometheus_config { enable: true, path: "/custom/metrics" }', ("/custom/metrics",)),
    ("prometheus_config { enable: true }", ("/monitoring/prometheus/metrics",)),  # TF Serving's default path
    ("prometheus_config { enable: false }", ()),
    ("", ()),  # nothing enabled: TF Serving serves no metrics then
])
def test_the_file_decides(tmp_path: Path, text: str, paths: tuple[str, ...]) -> None:
    assert metrics_paths(config(tmp_path, text)) == paths


@pytest.mark.parametrize(("text", "why"), [
    ("prometheus_config { enable: true, port: 9 }", 'no field named "port"'),
    ("prometheus_config { enable: yes please }", "monitoring.config is not a MonitoringConfig"),
    ('prometheus_config { enable: true, path: "metrics" }', "must start with /"),
])
def test_a_bad_file_is_a_clear_error(tmp_path: Path, text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        metrics_paths(config(tmp_path, text))
    with pytest.raises(ValueError, match="cannot read --monitoring_config_file"):
        metrics_paths(str(tmp_path / "missing.config"))
