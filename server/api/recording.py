"""Counting and timing every RPC of every front-end the same way (mirrorserve_requests_total and
mirrorserve_request_duration_seconds), labelled by protocol, model, version, method and code; and
ending a failed one the same way, through the one status table."""

from __future__ import annotations

import time
from typing import Any

import grpc

from server import metrics
from server.api.refusals import REFUSAL_LOG, is_refusal
from server.api.status import status_for
from server.core.servables import Registry, Servable
from server.errors import ModelError, ModelFailure

INFERENCE_APIS = {("tfserving", "Predict"): ("Predict", "GRPC"), ("tfserving-rest", "Predict"): ("predict", "REST"),
                  ("tfserving", "Classify"): ("Classify", "GRPC"), ("tfserving-rest", "Classify"): ("classify", "REST"),
                  ("tfserving", "Regress"): ("Regress", "GRPC"), ("tfserving-rest", "Regress"): ("regress", "REST"),
                  ("tfserving", "MultiInference"): ("MultiInference", "GRPC"),
                  ("v2", "ModelInfer"): ("ModelInfer", "GRPC"), ("v2-rest", "ModelInfer"): ("infer", "REST")}
"""TF Serving's API and entrypoint labels of each inference method (its series, server.metrics)."""


class Recorder:
    def __init__(self, registry: Registry, protocol: str) -> None:
        self._registry = registry
        self._protocol = protocol
        self._unresolved: dict[tuple[str, str, grpc.StatusCode], tuple[Any, Any]] = {}

    def record(self, method: str, code: grpc.StatusCode, started: float, servable: Servable | None = None,
               name: str = "") -> float:
        """Count the RPC under its version when one was resolved, else under its model if that is
        configured, else under model="" (so clients cannot mint label values). The metric children
        are looked up once per (version, method, code) and kept. Returns the seconds observed."""
        if servable is not None:
            key: tuple[Any, ...] = ("metrics", self._protocol, method, code)
            pair = servable.cache.get(key)
            if pair is None:
                labels = (self._protocol, servable.name, str(servable.version))
                pair = servable.cache[key] = (metrics.REQUESTS.labels(*labels, method, code.name),
                                              metrics.REQUEST_SECONDS.labels(*labels, method))
        else:
            model = self._registry.metric_label(name)
            pair = self._unresolved.get((model, method, code))
            if pair is None:
                pair = self._unresolved[model, method, code] = (
                    metrics.REQUESTS.labels(self._protocol, model, "", method, code.name),
                    metrics.REQUEST_SECONDS.labels(self._protocol, model, "", method))
        seconds = time.perf_counter() - started
        pair[0].inc()
        pair[1].observe(seconds)
        api = INFERENCE_APIS.get((self._protocol, method))
        if api is not None:
            model = servable.name if servable is not None else self._registry.metric_label(name)
            metrics.TFS_REQUEST_COUNT.inc(model, code.name)
            if code is grpc.StatusCode.OK and servable is not None:
                self._tfs_children(servable, method, api)[0].observe(seconds * 1e6)
        return seconds

    @staticmethod
    def record_target(servable: Servable, seconds: float) -> None:
        """An answered inference of a version with a latency target: its time over the target in
        mirrorserve_latency_target_ratio, and, over it, a count in mirrorserve_over_target_total."""
        policy = servable.batching
        if policy is None or policy.target_latency_s is None:
            return
        labels = (servable.name, str(servable.version))
        metrics.TARGET_RATIO.labels(*labels).observe(seconds / policy.target_latency_s)
        if seconds > policy.target_latency_s:
            metrics.OVER_TARGET.labels(*labels).inc()

    def record_runtime(self, method: str, servable: Servable, seconds: float) -> None:
        """TF Serving's runtime_latency of an OK inference: the model's time on its batches."""
        api = INFERENCE_APIS.get((self._protocol, method))
        if api is not None:
            self._tfs_children(servable, method, api)[1].observe(seconds * 1e6)

    def _tfs_children(self, servable: Servable, method: str, api: tuple[str, str]) -> tuple[Any, Any]:
        """TF Serving's request_latency and runtime_latency children of a version, made once."""
        key = ("tfs-metrics", self._protocol, method)
        children = servable.cache.get(key)
        if children is None:
            children = servable.cache[key] = (metrics.TFS_REQUEST_LATENCY.labels(servable.name, *api),
                                              metrics.TFS_RUNTIME_LATENCY.labels(servable.name, api[0], "TF1"))
        return children

    def failed(self, method: str, exc: BaseException, started: float, servable: Servable | None = None,
               name: str = "", peer: str = "") -> tuple[grpc.StatusCode, str]:
        """Account for a request that raised: count a model failure against its version, map the
        exception to its status and message (server.api.status), record it, and log it if it is a
        refusal (server.api.refusals)."""
        if isinstance(exc, ModelFailure | ModelError) and servable is not None:
            metrics.MODEL_FAILURES.labels(servable.name, str(servable.version)).inc()
        code, message = status_for(exc)
        self.record(method, code, started, servable, name)
        if is_refusal(exc):
            REFUSAL_LOG.refused(f"{self._protocol} {method} ({code.name}, {type(exc).__name__})", message, peer)
        return code, message
