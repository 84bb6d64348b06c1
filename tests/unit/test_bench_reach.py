"""Goal a's reach: the most req/s this machine allowed any gRPC server, by a run's own figures."""

from __future__ import annotations

import os

import pytest

from bench import judge as suite
from bench.results import ModelResults, Run


def closed(concurrency: int, req_per_s: float, server_us: float, client_us: float) -> Run:
    return Run(mode="closed", concurrency=concurrency, rate=0.0, rows=1, seconds=1.0, requests=1, codes={"OK": 1},
               req_per_s=req_per_s, rows_per_s=req_per_s, p50_ms=1.0, p90_ms=1.0, p99_ms=1.0, p999_ms=1.0,
               max_ms=1.0, server_cpu_us=server_us, client_cpu_us=client_us)


def model_run(fixed_req_per_s: float, per_row: dict[str, float] | None) -> ModelResults:
    """One model's results: the fixed-response server and three others at 1 and 64 clients."""
    return ModelResults(closed={
        "fixed": [closed(1, 2000, 300, 230), closed(64, fixed_req_per_s, 200, 170)],
        "off": [closed(1, 600, 700, 250), closed(64, 900, 650, 230)],
        "default": [closed(1, 650, 700, 250), closed(64, 3000, 280, 100)],
        "reference": [closed(1, 250, 1700, 350), closed(64, 3500, 300, 80)],
    }, inprocess_cpu_us_per_row=per_row)


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})


@pytest.mark.usefixtures("two_cores")
def test_a_cheap_model_is_held_to_the_fixed_response_servers_own_rate() -> None:
    # least CPU a request: 20 (model at batch 64) + 200 (fixed server) + 80 (reference's client) = 300 µs,
    # so two cores allow 6,667 req/s; the fixed-response server answered 4,000
    reach = suite.machine_reach(model_run(4000, {"1": 400.0, "16": 60.0, "64": 20.0}))
    assert reach == {"reach_req_per_s": 4000, "cores": 2, "least_cpu_us": 300.0, "model_cpu_us_per_row": 20.0}


@pytest.mark.usefixtures("two_cores")
def test_a_costly_model_is_held_to_the_cores_over_the_least_cpu_a_request_needs() -> None:
    # 1,720 (the model at its cheapest batch size, here 16 rows) + 200 + 80 = 2,000 µs: two cores, 1,000 req/s
    reach = suite.machine_reach(model_run(4000, {"1": 3000.0, "16": 1720.0, "64": 1750.0}))
    assert reach is not None and reach["reach_req_per_s"] == pytest.approx(1000.0)
    assert reach["least_cpu_us"] == 2000.0


def test_a_run_without_the_models_cpu_has_no_reach() -> None:
    assert suite.machine_reach(model_run(4000, None)) is None


@pytest.mark.usefixtures("two_cores")
def test_goal_a_gives_the_reach_beside_the_ratio() -> None:
    run = model_run(4000, {"1": 400.0, "16": 60.0, "64": 20.0})
    (a, _, _, _) = suite.goals({"dense": run})  # a model that goals c and d do not judge
    assert a.status == "FAIL" and a.summary == "dense 0.86 (reach 1.14)"  # 3,000 / 3,500; 4,000 / 3,500
    assert a.figures["dense"]["ratio"] == pytest.approx(3000 / 3500)
    assert a.figures["dense"]["reach_ratio"] == pytest.approx(4000 / 3500)
