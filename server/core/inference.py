"""The core calls every front-end makes to run a request: resolve -> decode -> `infer` -> encode.

`Registry.resolve` picks the model version (by number, label, or the highest available) before the
inputs are decoded, so a request for a model that is not served costs no decoding, and a bad input
is counted against the version it was sent to. `infer` then finds the signature (serving_default
when none is named), checks the inputs against it, batches them with every other request to that
version, and returns the outputs asked for (all of them, in the signature's order, when none are
named; else in the order asked). Everything a front-end does around them is translation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from server.core.prediction import Predictor
from server.core.servables import Servable
from server.core.signatures import DEFAULT_SIGNATURE, Signature
from server.errors import Unavailable


@dataclass(slots=True)  # a value, never changed; slots, not frozen: made per request or batch
class Inference:
    servable: Servable
    signature: str
    """The signature that ran (the default's name filled in)."""
    outputs: dict[str, np.ndarray]
    queue_seconds: float
    compute_seconds: float
    """The model's time on this request's batches."""
    input_seconds: float
    """Handing those batches to the model (server.core.batcher.BatchTiming)."""
    output_seconds: float
    """Getting their outputs back and split."""


def predictor_of(servable: Servable) -> Predictor:
    """A resolved servable's predictor. Resolution only returns servables that have one; a request
    that held its version past the wait of a retiring one (lifecycle.RETIRE_WAIT_S) finds it gone."""
    predictor = servable.predictor
    if predictor is None:
        raise Unavailable(f"model '{servable.name}' version {servable.version} was unloaded while the request "
                          f"was being read; retry, and the request goes to the version serving now")
    return predictor


def signature_of(servable: Servable, name: str) -> Signature:
    """The servable's signature `name` (the default when empty); InvalidInput naming the ones there are."""
    return predictor_of(servable).signature(name or DEFAULT_SIGNATURE)


async def infer(servable: Servable, signature: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str],
                deadline: float | None) -> Inference:
    """Run one request on the version it resolved to."""
    predictor = predictor_of(servable)
    chosen = predictor.signature(signature or DEFAULT_SIGNATURE)
    answer = await predictor.predict(chosen, inputs, outputs, deadline)
    return Inference(servable, chosen.name, answer.outputs, answer.queue_seconds, answer.compute_seconds,
                     answer.input_seconds, answer.output_seconds)
