"""The served model versions and how a request finds one. Pure: no TensorFlow, no gRPC.

A servable is one version of one model, in TensorFlow Serving's states (START, LOADING,
AVAILABLE, UNLOADING, END). The lifecycle (server.core.lifecycle) moves versions through the states;
the front-ends only call `Registry.resolve`, which returns an AVAILABLE version or raises the
domain error that names what was asked and what exists.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from server.core.batching_policy import BatchingPolicy
from server.core.latency_target import one_row_fits
from server.core.model_config import ModelSource
from server.core.prediction import Predictor
from server.core.signatures import SignatureDefinition
from server.core.statistics import VersionStatistics
from server.errors import InvalidInput, NotFound, Unavailable


class State(enum.IntEnum):
    """ModelVersionStatus.State of TensorFlow Serving, same numbers."""

    START = 10
    LOADING = 20
    AVAILABLE = 30
    UNLOADING = 40
    END = 50


_ids = itertools.count(1)


@dataclass(eq=False)
class Servable:
    name: str
    version: int
    path: str
    id: int = field(default_factory=lambda: next(_ids))
    """The model worker's handle on this load of the version (a reload gets a new one)."""
    state: State = State.START
    error: tuple[int, str] | None = None
    """tensorflow.error.Code and message of the last failed load."""
    failures: int = 0
    """Failed loads in a row; sets the retry back-off."""
    retry_at: float = 0.0
    predictor: Predictor | None = None
    """While AVAILABLE (and UNLOADING, for requests already queued)."""
    signature_defs: Mapping[str, SignatureDefinition] = field(default_factory=dict)
    cache: dict[Hashable, Any] = field(default_factory=dict)
    """Values the front-ends build once per version (response protos, metric children)."""
    batching: BatchingPolicy | None = None
    """How its requests are batched (the server's policy with the model's own fields over it)."""
    run_cost: tuple[float, float] = (0.0, 0.0)
    """(a, b): its run time as a + b·rows seconds, as its warm-up measured it."""
    statistics: VersionStatistics = field(default_factory=VersionStatistics)
    """Its figures since this load (Triton's ModelStatistics)."""
    holders: int = 0
    """Requests that resolved to this version and are not answered yet (TF Serving's ServableHandle):
    a retiring version is unloaded only once none holds it, so a request that resolved to it
    before a rollout, and then awaited its body's decoding, still finds it there."""
    _unheld: list[asyncio.Future[None]] = field(default_factory=list, repr=False)

    def target_note(self) -> str:
        """What its status says of a latency target a lone row cannot meet ("" otherwise): derived
        from its policy and warm-up cost, so every front-end says the same without being told."""
        policy = self.batching
        target = policy.target_latency_s if policy is not None and policy.batching else None
        if target is None or one_row_fits(target, *self.run_cost):
            return ""
        return (f"its latency target of {target * 1000:g} ms is below a one-row run ({sum(self.run_cost) * 1000:.1f} "
                f"ms as warmed up): every answer will miss it; it is served as without a target, nothing refused "
                f"for it")

    def hold(self) -> None:
        self.holders += 1

    def release(self) -> None:
        self.holders -= 1
        if not self.holders:
            for waiter in self._unheld:
                if not waiter.done():
                    waiter.set_result(None)
            self._unheld.clear()

    async def unheld(self, timeout_s: float) -> bool:
        """Wait until no request holds it, at most `timeout_s`; False if some still do then."""
        if not self.holders:
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._unheld.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
        except TimeoutError:
            return False
        return True


@dataclass(eq=False)
class Model:
    source: ModelSource
    versions: dict[int, Servable] = field(default_factory=dict)
    default: Servable | None = None
    """The highest AVAILABLE version: what a request naming no version gets."""

    def refresh(self) -> None:
        available = [s for s in self.versions.values() if s.state is State.AVAILABLE]
        self.default = max(available, key=lambda s: s.version) if available else None

    def available_versions(self) -> list[int]:
        return sorted(v for v, s in self.versions.items() if s.state is State.AVAILABLE)


class Registry:
    """Configured models by name. Mutated only by the lifecycle, on the event loop."""

    def __init__(self) -> None:
        self.models: dict[str, Model] = {}
        self.starting = True
        """Until every start-up model serves: what is not there yet is UNAVAILABLE (retry), not
        NOT_FOUND, as health is NOT_SERVING."""

    def names(self) -> str:
        return ", ".join(sorted(self.models)) or "none"

    def model(self, name: str) -> Model:
        if not name:
            raise InvalidInput(f"model_spec.name is empty; models served: {self.names()}")
        model = self.models.get(name)
        if model is None and self.starting:
            raise Unavailable(f"model '{name}' is loading (the server is starting); retry shortly")
        if model is None:
            raise NotFound(f"model '{name}' not found; models served: {self.names()}")
        return model

    def metric_label(self, name: str) -> str:
        """A requested model name as a metric label: configured names only, else "" (clients
        must not mint label values)."""
        return name if name in self.models else ""

    @staticmethod
    def labelled_version(model: Model, label: str) -> int:
        labels = model.source.labels
        if label not in labels:
            known = ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "none"
            raise NotFound(f"version label '{label}' of model '{model.source.name}' not found; labels: {known}")
        return labels[label]

    def resolve(self, name: str, version: int | None = None, label: str | None = None) -> Servable:
        """The AVAILABLE servable a request addresses: by version, by label, or the highest."""
        model = self.model(name)
        if version is None and label is None:
            if model.default is not None:
                return model.default
            if self.starting or any(s.state is State.LOADING for s in model.versions.values()):
                raise Unavailable(f"model '{name}' is loading; retry shortly")
            raise NotFound(f"model '{name}' has no available version{_failures(model)}")
        if label is not None:
            version = self.labelled_version(model, label)
            asked = f"model '{name}' version {version} (label '{label}')"
        else:
            asked = f"model '{name}' version {version}"
        assert version is not None
        servable = model.versions.get(version)
        if servable is not None and servable.state is State.AVAILABLE:
            return servable
        if servable is not None and servable.state in (State.START, State.LOADING):
            raise Unavailable(f"{asked} is loading; retry shortly")
        available = ", ".join(str(v) for v in model.available_versions()) or "none"
        raise NotFound(f"{asked} not found; available versions: {available}")


def _failures(model: Model) -> str:
    failed = [s for s in model.versions.values() if s.error is not None]
    if not failed:
        return f" (no version folder under {model.source.base_path} is served by its policy)"
    last = max(failed, key=lambda s: s.version)
    return f"; version {last.version} failed to load: {last.error[1] if last.error else ''}"
