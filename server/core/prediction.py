"""The request path between a front-end and one model version's batcher, in plain types: which
signature a request addresses, whether its inputs fit, and which outputs it gets back. (Which
version it addresses is server.core.servables' business.)"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np

from server.core.batcher import Answer, Batcher
from server.core.signatures import DEFAULT_SIGNATURE, ModelInfo, Signature
from server.errors import InvalidInput


class Predictor:
    def __init__(self, model: ModelInfo, batcher: Batcher) -> None:
        self.model = model
        self.batcher = batcher

    def signature(self, name: str) -> Signature:
        name = name or DEFAULT_SIGNATURE
        signature = self.model.signatures.get(name)
        if signature is None:
            available = ", ".join(sorted(self.model.signatures)) or "none"
            raise InvalidInput(
                f"signature '{name}' not found in model '{self.model.name}'; available: {available}"
            )
        return signature

    async def predict(
        self,
        signature: Signature,
        inputs: Mapping[str, np.ndarray],
        output_filter: Iterable[str],
        deadline: float | None = None,
    ) -> Answer:
        """Validate, queue for a batch, and return this request's rows of the outputs it asked for,
        in the order asked (each once), or of all outputs in signature order when it named none."""
        names = signature.select_outputs(output_filter)  # refuses unknown names before queueing
        if output_filter:
            names = tuple(dict.fromkeys(output_filter))
        rows, key = signature.admit(inputs)
        answer = await self.batcher.submit(key, inputs, rows, deadline=deadline)
        if tuple(answer.outputs) == names:
            return answer
        return dataclasses.replace(answer, outputs={n: answer.outputs[n] for n in names})
