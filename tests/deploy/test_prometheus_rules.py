"""deploy/prometheus passes promtool: the scrape config and the alert rules check, and the rules'
unit tests (alerts_test.yml) fire each alert on synthetic series and stay quiet on healthy ones."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import DEPLOY

PROMETHEUS = DEPLOY / "prometheus"


def promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed; `make test` installs Debian's prometheus package")
    return subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, check=False)


POD_META = ("__meta_kubernetes_namespace", "__meta_kubernetes_pod_name", "__meta_kubernetes_pod_ip",
            "__meta_kubernetes_pod_label_", "__meta_kubernetes_pod_annotation_")
"""Labels Kubernetes service discovery sets on role: pod targets (Prometheus documentation)."""


def test_scrape_config_checks(tmp_path: Path) -> None:
    done = promtool("check", "config", "prometheus.yml")
    output = done.stdout + done.stderr
    if done.returncode != 0 and "field kubernetes_sd_configs not found" in output:
        # Debian builds Prometheus without Kubernetes service discovery, so its promtool cannot
        # parse that one block. Check everything else with promtool (globals, relabelling, rule
        # files) on a copy whose discovery is a static target, and the discovery block here.
        config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
        for job in config["scrape_configs"]:
            assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
            job["static_configs"] = [{"targets": ["127.0.0.1:8501"]}]
            for rule in job["relabel_configs"]:
                for label in rule.get("source_labels", []):
                    assert label.startswith(POD_META), f"{label} is not set on role: pod targets"
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
        done = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
        output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "SUCCESS: 1 rule files found" in output, output


def test_alert_rules_check() -> None:
    done = promtool("check", "rules", "alerts.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 rules found" in done.stdout


def test_alert_rules_fire_on_synthetic_series() -> None:
    done = promtool("test", "rules", "alerts_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_rule_tests_can_fail(tmp_path: Path) -> None:
    """The latency test case expects a firing alert; with the SLO raised above the synthetic p99
    (497 ms) the same test must fail, so a passing run means the alert really fired."""
    raised = (PROMETHEUS / "alerts.yml").read_text().replace(") > 0.25", ") > 0.6")
    assert raised != (PROMETHEUS / "alerts.yml").read_text()
    (tmp_path / "alerts.yml").write_text(raised)
    shutil.copy(PROMETHEUS / "alerts_test.yml", tmp_path / "alerts_test.yml")
    done = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert done.returncode != 0
    assert "MirrorservePredictLatencyHigh" in done.stdout + done.stderr
