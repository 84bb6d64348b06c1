"""TF Serving's Classify, Regress and MultiInference messages <-> the core's ExampleMethods, for
the gRPC handlers (server.api.tfserving.grpc_service) and warmup records alike.

Requests are read as TF Serving reads them itself (its internal SerializedInput): each example
stays serialized, so an example that is not a tf.Example is refused by its index, and what the
model gets is the client's own bytes (merged with the context's), never decoded and encoded again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from protos.tensorflow_serving import classification_pb2, inference_pb2, regression_pb2
from server.api.http.body import BodyDecoder
from server.api.tfserving import tf_example
from server.core.example_methods import CLASSES, CLASSIFY, OUTPUTS, REGRESS, SCORES, ExampleMethods, Task
from server.core.inference import Inference, predictor_of
from server.core.servables import Servable
from server.core.signatures import ExampleFeature


def label_text(label: bytes) -> str:
    """A class label for a proto3 string field: UTF-8, any byte that is not replaced by U+FFFD."""
    return label.decode("utf-8", "replace")


class ExampleCalls:
    """decode -> ExampleMethods -> results, on a servable already chosen."""

    def __init__(self, methods: ExampleMethods, decoder: BodyDecoder, max_bytes: int) -> None:
        self.methods = methods
        self._decoder = decoder
        self._max_bytes = max_bytes

    async def examples(self, servable: Servable, features: Mapping[str, ExampleFeature] | None,
                       serialized_input: Any) -> list[bytes]:
        """The input's examples, checked against the features their signature reads, and merged."""
        return await tf_example.read(serialized_input, features, self._max_bytes, self._decoder,
                                     predictor_of(servable).batcher.check_size)

    async def run(self, servable: Servable, method: str, request: Any, deadline: float | None) -> Inference:
        """A SerializedExamplesRequest (Classify's or Regress's) on `servable`."""
        signature = request.model_spec.signature_name
        chosen = self.methods.signature(servable, signature, method)
        examples = await self.examples(servable, chosen.features, request.input)
        if method == CLASSIFY:
            return await self.methods.classify(servable, signature, examples, deadline)
        return await self.methods.regress(servable, signature, examples, deadline)

    async def multi_inference(self, servable: Servable, request: Any, deadline: float | None) -> list[Inference]:
        """A SerializedMultiInferenceRequest on `servable`: every task checked before any runs."""
        tasks = [Task(t.model_spec.signature_name, t.method_name) for t in request.tasks]
        self.methods.tasks(servable, tasks)
        # The examples are checked against what each task's signature reads, once per different
        # set of features (the tasks of one model mostly parse the same ones).
        checked: list[Mapping[str, ExampleFeature] | None] = []
        examples: list[bytes] = []
        for task in tasks:
            features = self.methods.signature(servable, task.signature, task.method).features
            if features not in checked:
                checked.append(features)
                examples = await self.examples(servable, features, request.input)
        return await self.methods.multi_inference(servable, tasks, examples, deadline)


def fill_classification(result: Inference, into: Any) -> None:
    """A ClassificationResult: per example, a Class per column of classes and/or scores (a label
    left empty without classes, a score 0 without scores, as TF Serving)."""
    classes = result.outputs.get(CLASSES)
    scores = result.outputs.get(SCORES)
    rows, columns = (classes if classes is not None else scores).shape  # type: ignore[union-attr]
    score_rows = None if scores is None else scores.tolist()
    for row in range(rows):
        entries = into.classifications.add().classes
        for column in range(columns):
            entry = entries.add()
            if classes is not None:
                entry.label = label_text(classes[row, column])
            if score_rows is not None:
                entry.score = score_rows[row][column]


def fill_regression(result: Inference, into: Any) -> None:
    for value in result.outputs[OUTPUTS].tolist():
        into.regressions.add().value = value


def classification_response(result: Inference, spec: Any) -> Any:
    """A ClassificationResponse naming `spec` (the ModelSpec that answered)."""
    response = classification_pb2.ClassificationResponse(model_spec=spec)
    fill_classification(result, response.result)
    return response


def regression_response(result: Inference, spec: Any) -> Any:
    response = regression_pb2.RegressionResponse(model_spec=spec)
    fill_regression(result, response.result)
    return response


def multi_inference_response(results: list[Inference], methods: list[str],
                             spec_of: Callable[[Servable, str], Any]) -> Any:
    """A MultiInferenceResponse, each task's result naming the ModelSpec `spec_of` gives."""
    response = inference_pb2.MultiInferenceResponse()
    for result, method in zip(results, methods, strict=True):
        entry = response.results.add(model_spec=spec_of(result.servable, result.signature))
        if method == CLASSIFY:
            fill_classification(result, entry.classification_result)
        else:
            assert method == REGRESS
            fill_regression(result, entry.regression_result)
    return response
