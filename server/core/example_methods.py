"""TF Serving's Classify, Regress and MultiInference, in plain types: which signature a call may
use, running its serialized tf.Examples through the same batcher as every other request, and
TensorFlow Serving's checks on what the signature returns (servables/tensorflow/classifier.cc,
regressor.cc and multi_inference.cc). No protos: the front-ends decode and encode.

A classify signature takes one input, "inputs", a vector of serialized tf.Examples, and returns
"classes" (string labels), "scores" (float), or both, each [batch_size, num_classes]. A regress
signature takes the same input and returns "outputs", float, [batch_size] or [batch_size, 1].
Whether the signature's method_name must say so is TF Serving's --enable_signature_method_name_check
(off by default there and here: TF2 exports every signature as "predict", and TF Serving serves
those by their shape). Either way a signature of another shape is refused, naming what it has.

The examples of concurrent calls share batches like any request's rows: the batch key is the
signature and the input's (empty) trailing shape. Each example must already have passed the checks
of server.api.tfserving.tf_example, so one bad example cannot fail its neighbours' batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import numpy as np

from server.core.inference import Inference, infer, predictor_of
from server.core.servables import Servable
from server.core.signatures import DEFAULT_SIGNATURE, Signature, TensorSpec
from server.dtypes import tf_name
from server.errors import InvalidInput, Unimplemented

CLASSIFY = "tensorflow/serving/classify"
REGRESS = "tensorflow/serving/regress"
INPUTS = "inputs"
CLASSES = "classes"
SCORES = "scores"
OUTPUTS = "outputs"
FLOAT = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of a MultiInference call: a signature and what to do with it."""

    signature: str
    method: str


def _dims(shape: tuple[int | None, ...] | None) -> str:
    return "unknown" if shape is None else str([-1 if d is None else d for d in shape])


def _names(names: Sequence[str]) -> str:
    return ", ".join(f"'{n}'" for n in names) or "none"


class ExampleMethods:
    """The three calls, for every front-end; `check_method_name` is TF Serving's flag."""

    def __init__(self, check_method_name: bool = False) -> None:
        self.check_method_name = check_method_name

    def signature(self, servable: Servable, name: str, method: str) -> Signature:
        """The version's signature `name` (serving_default when empty), if it can serve `method`;
        else InvalidInput saying why, in substance TF Serving's words."""
        name = name or DEFAULT_SIGNATURE
        key = ("example-signature", name, method, self.check_method_name)
        cached = servable.cache.get(key)
        if cached is None:
            cached = servable.cache[key] = self._signature(servable, name, method)
        return cached

    def _signature(self, servable: Servable, name: str, method: str) -> Signature:
        verb = "classify" if method == CLASSIFY else "regress"
        definition = servable.signature_defs.get(name)
        signature = predictor_of(servable).signature(name)  # refuses unknown names
        assert definition is not None, f"signature {name} has no SignatureDef"
        what = f"signature '{name}' (method_name '{definition.method_name}') cannot {verb}"
        if self.check_method_name and definition.method_name != method:
            raise InvalidInput(f"{what}: Expected {verb} signature method_name to be {method} "
                               f"(--signature-method-name-check)")
        inputs = sorted(signature.inputs)
        if inputs != [INPUTS]:
            raise InvalidInput(f"{what}: a {verb} signature has exactly one input, '{INPUTS}' (serialized "
                               f"tf.Examples); it has {_names(inputs)}")
        spec = signature.inputs[INPUTS]
        if spec.dtype != object or spec.shape is None or len(spec.shape) != 1 or not signature.batched:
            raise InvalidInput(f"{what}: its input '{INPUTS}' is {spec.describe()}, not a vector of serialized "
                               f"tf.Examples (DT_STRING [-1])")
        outputs = sorted(signature.outputs)
        if method == CLASSIFY:
            if not set(outputs) & {CLASSES, SCORES} or len(outputs) > 2 or not set(outputs) <= {CLASSES, SCORES}:
                raise InvalidInput(f"{what}: a classify signature returns '{CLASSES}', '{SCORES}' or both and "
                                   f"nothing else; it returns {_names(outputs)}")
            for output, dtype in ((CLASSES, np.dtype(object)), (SCORES, FLOAT)):
                if output in signature.outputs:
                    _check_spec(what, output, signature.outputs[output], dtype, (2,))
        else:
            if outputs != [OUTPUTS]:
                raise InvalidInput(f"{what}: a regress signature returns one output, '{OUTPUTS}'; it returns "
                                   f"{_names(outputs)}")
            _check_spec(what, OUTPUTS, signature.outputs[OUTPUTS], FLOAT, (1, 2))
        return signature

    async def classify(self, servable: Servable, signature: str, examples: Sequence[bytes],
                       deadline: float | None) -> Inference:
        """The classes and/or scores of each example: outputs "classes" (labels, bytes) and
        "scores" (float32), each [len(examples), num_classes]."""
        chosen = self.signature(servable, signature, CLASSIFY)
        wanted = [n for n in (CLASSES, SCORES) if n in chosen.outputs]
        result = await infer(servable, chosen.name, {INPUTS: _vector(examples)}, wanted, deadline)
        check_classification(result, len(examples))
        return result

    async def regress(self, servable: Servable, signature: str, examples: Sequence[bytes],
                      deadline: float | None) -> Inference:
        """One value per example: output "outputs", float32 [len(examples)]."""
        chosen = self.signature(servable, signature, REGRESS)
        result = await infer(servable, chosen.name, {INPUTS: _vector(examples)}, (OUTPUTS,), deadline)
        check_regression(result, len(examples))
        return result

    def tasks(self, servable: Servable, tasks: Sequence[Task]) -> None:
        """MultiInference's checks, all before anything runs: at least one task, no signature
        twice, each a classify or regress that its signature can serve."""
        if not tasks:
            raise InvalidInput("the request has no tasks; MultiInference runs at least one")
        seen: set[str] = set()
        for task in tasks:
            name = task.signature or DEFAULT_SIGNATURE
            if name in seen:
                raise InvalidInput(f"Duplicate evaluation of signature: {name}")
            seen.add(name)
            if task.method not in (CLASSIFY, REGRESS):
                raise Unimplemented(f"Unsupported signature method_name: '{task.method[:100]}'; a task is "
                                    f"{CLASSIFY} or {REGRESS}")
            self.signature(servable, name, task.method)

    async def multi_inference(self, servable: Servable, tasks: Sequence[Task], examples: Sequence[bytes],
                              deadline: float | None) -> list[Inference]:
        """Every task on the same examples, at once (each signature batches with its own
        traffic); one result per task, in order. The first failure fails the call."""
        self.tasks(servable, tasks)
        calls = [self.classify(servable, t.signature, examples, deadline) if t.method == CLASSIFY
                 else self.regress(servable, t.signature, examples, deadline) for t in tasks]
        return list(await asyncio.gather(*calls))


def combined(results: Sequence[Inference]) -> Inference:
    """One Inference standing for a MultiInference call's tasks, for its timing: they ran at once,
    so its queue time is the longest task's and its compute the sum of theirs."""
    first = results[0]
    return Inference(first.servable, first.signature, {}, max(r.queue_seconds for r in results),
                     sum(r.compute_seconds for r in results), max(r.input_seconds for r in results),
                     max(r.output_seconds for r in results))


def _check_spec(what: str, output: str, spec: TensorSpec, dtype: np.dtype, ranks: tuple[int, ...]) -> None:
    """Refuse before running a signature whose declared output can never pass the checks below."""
    if spec.dtype != dtype:
        raise InvalidInput(f"{what}: its output '{output}' is {tf_name(spec.dtype)}; it must be {tf_name(dtype)}")
    if spec.shape is not None and len(spec.shape) not in ranks:
        shapes = " or ".join({1: "[batch_size]", 2: "[batch_size, 1]" if output == OUTPUTS else
                              "[batch_size, num_classes]"}[r] for r in ranks)
        raise InvalidInput(f"{what}: its output '{output}' has shape {_dims(spec.shape)}; it must be {shapes}")


def check_classification(result: Inference, examples: int) -> None:
    """TF Serving's PostProcessClassificationResult checks, on what the model returned."""
    outputs = result.outputs
    for output, dtype in ((CLASSES, np.dtype(object)), (SCORES, FLOAT)):
        array = outputs.get(output)
        if array is None:
            continue
        if array.ndim != 2:
            raise InvalidInput(f"the signature's '{output}' output has shape {list(array.shape)}: Expected Tensor "
                               f"shape: [batch_size num_classes]")
        if array.dtype != dtype:
            raise InvalidInput(f"the signature's '{output}' output is {tf_name(array.dtype)}; expected "
                               f"{tf_name(dtype)}")
        if array.shape[0] != examples:
            raise InvalidInput(f"the signature's '{output}' output has {array.shape[0]} rows for {examples} examples")
    if CLASSES in outputs and SCORES in outputs and outputs[CLASSES].shape[1] != outputs[SCORES].shape[1]:
        raise InvalidInput(f"Tensors class and score should match in dim_size(1). Got {outputs[CLASSES].shape[1]} "
                           f"vs. {outputs[SCORES].shape[1]}")


def check_regression(result: Inference, examples: int) -> None:
    """TF Serving's PostProcessRegressionResult checks; leaves "outputs" as [examples]."""
    array = result.outputs[OUTPUTS]
    if not (array.ndim == 1 or (array.ndim == 2 and array.shape[1] == 1)):
        raise InvalidInput(f"the signature's '{OUTPUTS}' output has shape {list(array.shape)}: Expected output Tensor "
                           f"shape to be either [batch_size] or [batch_size, 1]")
    if array.dtype != FLOAT:
        raise InvalidInput(f"the signature's '{OUTPUTS}' output is {tf_name(array.dtype)}; expected DT_FLOAT")
    if array.shape[0] != examples:
        raise InvalidInput(f"Input batch size did not match output batch size: {examples} vs. {array.shape[0]}")
    result.outputs[OUTPUTS] = array.reshape(examples)


def _vector(examples: Sequence[bytes]) -> np.ndarray:
    array = np.empty(len(examples), dtype=object)
    array[:] = examples
    return array
