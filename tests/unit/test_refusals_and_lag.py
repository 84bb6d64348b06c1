"""The refusal log and the event-loop lag watch: each logs at once, then at most once an interval,
with a fake clock (no sleeping)."""

from __future__ import annotations

import logging

import grpc
import pytest

from server.api.http.server import route_of
from server.api.refusals import RefusalLog
from server.frontends import loop_lag


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_of_refusals_is_one_line_then_one_summary_an_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    refusals = RefusalLog(interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="server.refusals"):
        assert refusals.refused("v2 ModelInfer (RESOURCE_EXHAUSTED, Overloaded)", "queue full", "ipv4:1.2.3.4:5")
        assert not any(refusals.refused("v2 ModelInfer (RESOURCE_EXHAUSTED, Overloaded)", "queue full", "p")
                       for _ in range(99))
        assert refusals.refused("http request (INVALID_ARGUMENT)", "LineTooLong", "9.9.9.9"), "kinds are apart"
        clock.now += 10.0
        assert refusals.refused("v2 ModelInfer (RESOURCE_EXHAUSTED, Overloaded)", "queue full", "p")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "refused v2 ModelInfer (RESOURCE_EXHAUSTED, Overloaded) from ipv4:1.2.3.4:5: queue full",
        "refused http request (INVALID_ARGUMENT) from 9.9.9.9: LineTooLong",
        "refused v2 ModelInfer (RESOURCE_EXHAUSTED, Overloaded) from p: queue full (99 more since the last such line)",
    ]


def test_a_blocked_loop_is_observed_always_and_warned_about_once_an_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    seen: list[float] = []
    watch = loop_lag.LagWatch(seen.append, clock)
    with caplog.at_level(logging.WARNING, logger="server.frontends.loop_lag"):
        assert not watch.woke(0.002)
        assert watch.woke(1.5)
        clock.now += 1
        assert not watch.woke(3.0)
        clock.now += loop_lag.WARN_EVERY_S
        assert watch.woke(1.2)
    assert seen == [0.002, 1.5, 3.0, 1.2]
    assert [r.getMessage() for r in caplog.records] == [
        "the event loop was blocked for 1.5s: every request on every protocol waited that long",
        "the event loop was blocked for 1.2s: every request on every protocol waited that long "
        "(and up to 3.0s since the last warning)",
    ]


@pytest.mark.parametrize(("method", "path", "labels"), [
    ("POST", "/v1/models/m:predict", ("tfserving-rest", "Predict")),
    ("POST", "/v1/models/m/versions/3:classify", ("tfserving-rest", "Classify")),
    ("GET", "/v1/models/m/labels/x/metadata", ("tfserving-rest", "GetModelMetadata")),
    ("GET", "/v1/models/m", ("tfserving-rest", "GetModelStatus")),
    ("POST", "/v2/models/m/versions/1/infer", ("v2-rest", "ModelInfer")),
    ("GET", "/v2/models/m/ready", ("v2-rest", "ModelReady")),
    ("GET", "/v2/health/ready", ("v2-rest", "ServerReady")),
    ("GET", "/v2/health/live", ("v2-rest", "ServerLive")),
    ("GET", "/v2/models/m", ("v2-rest", "ModelMetadata")),
    ("GET", "/v2", ("v2-rest", "ServerMetadata")),
    ("GET", "/metrics", ("http", "Metrics")),
    ("GET", "/elsewhere", ("http", "")),
])
def test_a_refused_rest_request_is_labelled_by_its_url(method: str, path: str, labels: tuple[str, str]) -> None:
    assert route_of(method, path) == labels


def test_status_codes_of_the_new_refusals() -> None:
    from server.api.status import http_status_for, status_for
    from server.errors import (
        Overloaded,
        PermissionDenied,
        QueueFull,
        TooLargeInput,
        Unauthenticated,
        UnsupportedEncoding,
    )

    for exc, code, http in ((UnsupportedEncoding("x"), grpc.StatusCode.INVALID_ARGUMENT, 415),
                            (QueueFull("x"), grpc.StatusCode.UNAVAILABLE, 503),  # as TF Serving and Triton
                            (Overloaded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429),  # too many at once
                            (TooLargeInput("x"), grpc.StatusCode.INVALID_ARGUMENT, 400),
                            (PermissionDenied("x"), grpc.StatusCode.PERMISSION_DENIED, 403),
                            (Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED, 401)):
        assert status_for(exc) == (code, "x")
        assert http_status_for(exc, code) == http
