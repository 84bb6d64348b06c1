"""A real Prometheus (Debian's package, installed by `make test`) scrapes the server on loopback;
what it reads back through its HTTP API matches what the test sent and saw."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from client import AsyncPredictClient
from tests.integration.conftest import ROOT, ServerProcess, start_server

REQUESTS = 400
CONCURRENCY = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> float | None:
        """The single value of an instant query, or None when the result is empty."""
        result = self.series(expr)
        return float(result[0]["value"][1]) if result else None

    def series(self, expr: str) -> list[dict[str, Any]]:
        """Every series of an instant query (a malformed query fails the request)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def wait_for(self, expr: str, want: float, timeout: float = 30) -> float | None:
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.query(expr)
            if value == want:
                return value
            time.sleep(0.5)
        return value


@pytest.fixture(scope="module")
def demo_server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(["--model-base-path", str(model_dirs["demo"]), "--model-name", "demo",
                           "--replicas", "2", "--batch-timeout-ms", "5"],
                          tmp_path_factory.mktemp("server") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prometheus(demo_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    tmp_path = tmp_path_factory.mktemp("prometheus")
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed; `make test` installs Debian's package")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: mirrorserve\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{demo_server.metrics_port}']\n"
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.2)
        yield Prometheus(url)
    finally:
        process.terminate()
        process.wait(timeout=30)


async def send(target: str) -> list[float]:
    """REQUESTS one-row requests from CONCURRENCY concurrent callers; client latencies in seconds."""
    latencies: list[float] = []
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(REQUESTS)]
    async with AsyncPredictClient(target) as client:
        async def caller(index: int) -> None:
            for i in range(index, REQUESTS, CONCURRENCY):
                started = time.perf_counter()
                await client.predict("demo", {"x": inputs[i]}, timeout=30)
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(caller(c) for c in range(CONCURRENCY)))
    return latencies


def test_prometheus_reads_back_what_was_sent(demo_server: ServerProcess, prometheus: Prometheus) -> None:
    assert prometheus.wait_for('up{job="mirrorserve"}', 1.0) == 1.0
    assert prometheus.query('mirrorserve_model_ready{model="demo",version="1"}') == 1.0
    latencies = asyncio.run(send(demo_server.target))
    assert len(latencies) == REQUESTS

    count = prometheus.wait_for(
        'sum(mirrorserve_requests_total{model="demo",method="Predict",code="OK"})', float(REQUESTS))
    p99 = prometheus.query(
        'histogram_quantile(0.99, sum by (le) (mirrorserve_request_duration_seconds_bucket{method="Predict"}))')
    batches = prometheus.query('sum(mirrorserve_batch_rows_count{model="demo"})')
    multi_row = prometheus.query(
        'sum(mirrorserve_batch_rows_count{model="demo"}) - sum(mirrorserve_batch_rows_bucket{model="demo",le="1.0"})')
    mean_rows = prometheus.query(
        'sum(mirrorserve_batch_rows_sum{model="demo"}) / sum(mirrorserve_batch_rows_count{model="demo"})')
    traces = prometheus.query('sum(mirrorserve_tf_function_traces_total{model="demo"})')
    slowest = max(latencies)
    print(f"prometheus: requests={count} p99={p99} slowest_client={slowest:.4f}s batches={batches} "
          f"batches_over_1_row={multi_row} mean_rows={mean_rows} traces={traces}")

    assert count == REQUESTS
    assert p99 is not None and 0 < p99 < slowest
    assert multi_row is not None and multi_row > 0, "no batch larger than one row under concurrent load"
    assert mean_rows is not None and mean_rows > 1
    assert traces == 2.0  # one program per count of replicas in use (2 replicas), traced at load


TF_SERVING_QUERIES = {
    # As TF Serving's dashboards and alerts write them, against its metric names.
    "requests": 'sum(:tensorflow:serving:request_count{model_name="demo",status="OK"})',
    "p99 µs": 'histogram_quantile(0.99, sum by (le) (:tensorflow:serving:request_latency_bucket'
              '{model_name="demo",API="Predict",entrypoint="GRPC"}))',
    "runtime requests": 'sum(:tensorflow:serving:runtime_latency_count{model_name="demo",runtime="TF1"})',
    "mean queuing µs": "sum(:tensorflow:serving:batching_session:queuing_latency_sum) / "
                       "sum(:tensorflow:serving:batching_session:queuing_latency_count)",
    "batches": "sum(:tensorflow:serving:batching_session:processed_batch_size_count)",
}


def test_tf_servings_own_queries_run_on_its_metric_names(demo_server: ServerProcess, prometheus: Prometheus) -> None:
    """After the test above sent REQUESTS Predict calls: TF Serving's series, by its names."""
    found = {key: prometheus.wait_for(expr, float(REQUESTS)) if key in ("requests", "runtime requests")
             else prometheus.query(expr) for key, expr in TF_SERVING_QUERIES.items()}
    print(f"TF Serving's queries: {found}")
    assert found["requests"] == found["runtime requests"] == REQUESTS
    assert found["p99 µs"] is not None and 0 < found["p99 µs"] < 60e6
    assert found["mean queuing µs"] is not None and found["mean queuing µs"] >= 0
    assert found["batches"] is not None and 0 < found["batches"] <= REQUESTS


DASHBOARD = ROOT / "deploy" / "grafana" / "mirrorserve.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ADAPTER_RULES = ROOT / "deploy" / "k8s" / "prometheus-adapter" / "rules.yaml"
METRIC = re.compile(r"\bmirrorserve_[a-z_]+")
MAY_BE_EMPTY = {"Error ratio (server-side codes)"}
"""Panels whose query has no series while nothing fails (a ratio over no errors)."""


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    panels = [*panels, *(inner for p in panels for inner in p.get("panels", []))]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def test_dashboard_alert_and_autoscaler_queries_run_on_live_metrics(
        demo_server: ServerProcess, prometheus: Prometheus) -> None:
    """Every query of the Grafana dashboard, the alert rules and the prometheus-adapter rule names
    only metrics the server exports, and runs on a real Prometheus scraping it; the dashboard's and
    the adapter's return data."""
    asyncio.run(send(demo_server.target))
    exported = {line.split("{")[0].split(" ")[0] for line in demo_server.metrics_text().splitlines()
                if line.startswith("mirrorserve_")}
    queries = dashboard_queries()
    assert len(queries) >= 10
    alert_exprs = [rule["expr"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    adapter_rules = yaml.safe_load(ADAPTER_RULES.read_text())["rules"]
    adapter_exprs = [(f"prometheus-adapter rule {rule['name']['as']}",
                      rule["metricsQuery"].replace("<<.LabelMatchers>>", 'job="mirrorserve"')
                      .replace("<<.GroupBy>>", "instance")) for rule in adapter_rules]
    series_queries = [rule["seriesQuery"] for rule in adapter_rules]
    for expr in [e for _, e in queries] + alert_exprs + [e for _, e in adapter_exprs] + series_queries:
        names = set(METRIC.findall(expr))
        assert names and names <= exported, f"{expr!r} names metrics the server does not export: {names - exported}"

    for title, expr in [*queries, *adapter_exprs]:
        local = expr.replace("$__rate_interval", "30s").replace("$namespace", ".*").replace("$model", ".*")
        deadline = time.monotonic() + 30
        result = prometheus.series(local)
        while not result and title not in MAY_BE_EMPTY and time.monotonic() < deadline:
            time.sleep(1)
            result = prometheus.series(local)
        assert result or title in MAY_BE_EMPTY, f"{title}: {local!r} returned nothing"
    for expr in alert_exprs:
        prometheus.series(expr)  # parses and runs (no alert is expected to hold here)
