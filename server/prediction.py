"""The request path between the servicer and the batcher, in plain types: which model and
signature a request addresses, whether its inputs fit, and which outputs it gets back."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np

from server.batcher import Answer, Batcher
from server.errors import InvalidInput, NotFound
from server.signatures import DEFAULT_SIGNATURE, ModelInfo, Signature


class Predictor:
    def __init__(self, model: ModelInfo, batcher: Batcher) -> None:
        self.model = model
        self._batcher = batcher

    def check_model(self, name: str, version: int | None, version_label: str | None) -> None:
        """NotFound unless (name, version) is the served model."""
        served = f"this server serves model '{self.model.name}' version {self.model.version}"
        if not name:
            raise InvalidInput(f"model_spec.name is empty; {served}")
        if name != self.model.name:
            raise NotFound(f"model '{name}' not found; {served}")
        if version_label is not None:
            raise NotFound(f"version label '{version_label}' not found (labels are not supported); {served}")
        if version is not None and version != self.model.version:
            raise NotFound(f"model '{name}' version {version} not found; {served}")

    def signature(self, name: str) -> Signature:
        name = name or DEFAULT_SIGNATURE
        signature = self.model.signatures.get(name)
        if signature is None:
            available = ", ".join(sorted(self.model.signatures)) or "none"
            raise InvalidInput(
                f"signature '{name}' not found in model '{self.model.name}'; available: {available}"
            )
        problem = self.model.unservable.get(name)
        if problem is not None:
            raise InvalidInput(f"signature '{name}' cannot be served with row batching: {problem}")
        return signature

    async def predict(
        self,
        signature: Signature,
        inputs: Mapping[str, np.ndarray],
        output_filter: Iterable[str],
        deadline: float | None = None,
    ) -> Answer:
        """Validate, queue for a batch, and return the requested outputs of this request's rows."""
        names = signature.select_outputs(output_filter)
        rows, key = signature.admit(inputs)
        answer = await self._batcher.submit(key, inputs, rows, deadline=deadline)
        if len(names) == len(answer.outputs):
            return answer
        return dataclasses.replace(answer, outputs={n: answer.outputs[n] for n in names})
