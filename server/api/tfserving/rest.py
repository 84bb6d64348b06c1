"""TensorFlow Serving's REST API (g3doc/api_rest.md), the same URLs and JSON:

    GET  /v1/models/NAME[/versions/N | /labels/L]            the versions' status
    GET  /v1/models/NAME[/versions/N | /labels/L]/metadata   the signatures
    POST /v1/models/NAME[/versions/N | /labels/L]:predict    {"instances": ...} or {"inputs": ...}
    POST /v1/models/NAME[/versions/N | /labels/L]:classify   {"examples": [...], "context": {...}}
    POST /v1/models/NAME[/versions/N | /labels/L]:regress    the same

It only translates, like its gRPC twin (server.api.tfserving.grpc_service): the URL to a servable, the JSON
(server.api.tfserving.rest_json, server.api.tfserving.tf_example_json) to named arrays or examples, one call into the
same core, so REST and gRPC requests of a model share its batches.
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web
from google.protobuf import json_format

from server.api import request_log, request_timing
from server.api.admission import Call
from server.api.http import server as rest
from server.api.http.body import BodyDecoder, read_body
from server.api.recording import Recorder
from server.api.request_log import RequestLogs
from server.api.tfserving import examples as tfs_examples
from server.api.tfserving import rest_json as tfs_json
from server.api.tfserving import tf_example, tf_example_json
from server.api.tfserving.grpc_service import response_spec, signature_def_map
from server.api.tfserving.model_service import model_status
from server.core.example_methods import CLASSIFY, REGRESS, ExampleMethods
from server.core.inference import infer, predictor_of
from server.core.servables import Registry, Servable
from server.errors import InvalidInput, NotFound
from server.limits import MAX_VERSION, ascii_int64

PROTOCOL = "tfserving-rest"
_PATH = re.compile(r"/v1/models/(?P<name>[^/:]+)(?:/versions/(?P<version>[^/:]+)|/labels/(?P<label>[^/:]+))?"
                   r"(?P<suffix>/metadata|:[A-Za-z]+)?")
VERBS = (":predict", ":classify", ":regress")


def _proto_json(message: Any) -> Any:
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def _signature_def_json(servable: Servable) -> Any:
    """The SignatureDefMap as JSON, maps in key order (a proto map's own order varies by process)."""
    signature_map = _proto_json(signature_def_map(servable))
    return {"signature_def": {
        name: {**sdef, "inputs": dict(sorted(sdef["inputs"].items())), "outputs": dict(sorted(sdef["outputs"].items()))}
        for name, sdef in sorted(signature_map["signature_def"].items())}}


class TfsRest(rest.RestFrontEnd):
    def __init__(self, registry: Registry, max_body_bytes: int, decoder: BodyDecoder, methods: ExampleMethods,
                 default_timeout_s: float | None = None, logs: RequestLogs | None = None) -> None:
        """`default_timeout_s`: a request's deadline when it sends none (--rest-api-timeout-ms)."""
        super().__init__(Recorder(registry, PROTOCOL), default_timeout_s)
        self._methods = methods
        self._logs = logs
        self._registry = registry
        self._max_body_bytes = max_body_bytes
        self._decoder = decoder

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/v1/{tail:.*}", self.get), web.post("/v1/{tail:.*}", self.post)]

    @staticmethod
    def _parse(request: web.Request) -> tuple[str, int | None, str | None, str]:
        """(name, version, label, suffix) of a /v1/models URL."""
        match = _PATH.fullmatch(request.path)
        if match is None:
            raise NotFound(f"no such URL: {request.path}; the API is /v1/models/NAME[/versions/N|/labels/L]"
                           f"[/metadata|:predict]")
        text = match.group("version")
        version = None if text is None else ascii_int64(text)
        if text is not None and version is None:
            raise InvalidInput(f"version '{text[:40]}' in the URL is not a version number (ASCII digits, at most "
                               f"{MAX_VERSION})")
        return match.group("name"), version, match.group("label"), match.group("suffix") or ""

    @rest.rest_call("GetModelStatus")
    async def get(self, request: web.Request, call: Call) -> web.StreamResponse:
        call.name, version, label, suffix = self._parse(request)
        if suffix == "":
            return rest.json_response(_proto_json(model_status(self._registry, call.name, version, label)))
        call.method = "GetModelMetadata"
        if suffix != "/metadata":
            raise InvalidInput(f"'{suffix}' takes POST; GET serves the status and /metadata")
        call.servable = servable = self._registry.resolve(call.name, version, label)
        return rest.json_response({
            "model_spec": {"name": servable.name, "signature_name": "", "version": str(servable.version)},
            "metadata": {"signature_def": _signature_def_json(servable)}})

    @rest.rest_call("Predict", drained=True, counted=True)
    async def post(self, request: web.Request, call: Call) -> web.StreamResponse:
        call.name, version, label, suffix = self._parse(request)
        if suffix not in VERBS:
            raise InvalidInput(f"POST takes {', '.join(VERBS)}, not '{suffix or request.path}'")
        if suffix != ":predict":
            return await self._examples(request, call, version, label, suffix[1:])
        deadline = self.deadline(request)
        call.servable = servable = self._registry.resolve(call.name, version, label)
        raw = await read_body(request, self._max_body_bytes)
        signature, row_format, inputs = await self._decoder.decode(
            len(raw), tfs_json.decode_predict_body, raw, _input_specs(servable), self._max_body_bytes)
        # inputs is None only for a signature the version does not serve, which infer refuses first.
        result = await call.infer(infer(servable, signature, inputs or {}, (), deadline))
        response = rest.json_response(tfs_json.encode_outputs(result.outputs, row_format))
        response.headers[request_timing.SERVER_TIMING] = request_timing.server_timing(call.answered())
        logger = None if self._logs is None else self._logs.sample(result.servable)
        if logger is not None:
            logger.put(request_log.predict_record_of_arrays(result.servable, result.signature, logger.rate,
                                                            inputs or {}, result.outputs))
        return response

    async def _examples(self, request: web.Request, call: Call, version: int | None, label: str | None,
                        verb: str) -> web.StreamResponse:
        """:classify or :regress."""
        call.method = verb.capitalize()
        method = CLASSIFY if verb == "classify" else REGRESS
        deadline = self.deadline(request)
        call.servable = servable = self._registry.resolve(call.name, version, label)
        raw = await read_body(request, self._max_body_bytes)
        signature, examples, context = await self._decoder.run(
            len(raw) <= tf_example.INLINE_JSON_BYTES, len(raw), tf_example_json.decode_body, raw, verb,
            _example_features(servable), self._max_body_bytes, predictor_of(servable).batcher.max_queued_rows)
        merged = tf_example.merged(examples, context)
        if method == CLASSIFY:
            result = await call.infer(self._methods.classify(servable, signature, merged, deadline))
            body, kind = tf_example_json.classification_json(result.outputs), "classify_log"
        else:
            result = await call.infer(self._methods.regress(servable, signature, merged, deadline))
            body, kind = tf_example_json.regression_json(result.outputs), "regress_log"
        response = rest.json_response(body)
        response.headers[request_timing.SERVER_TIMING] = request_timing.server_timing(call.answered())
        logger = None if self._logs is None else self._logs.sample(result.servable)
        if logger is not None:
            grpc_form = (tfs_examples.classification_response if method == CLASSIFY
                         else tfs_examples.regression_response)(result, response_spec(result.servable,
                                                                                       result.signature))
            logger.put(request_log.call_record(result.servable, result.signature, logger.rate, kind,
                                                  tf_example.request_bytes(
                                                      result.servable.name, result.signature, examples, context),
                                                  grpc_form))
        return response


def _example_features(servable: Servable) -> dict[str, Any]:
    """The features each signature that parses tf.Examples reads, where the worker could tell
    (built once a version): what checking a :classify or :regress body needs."""
    features = servable.cache.get("example-features")
    if features is None:
        model = predictor_of(servable).model
        features = servable.cache["example-features"] = {name: signature.features for name, signature
                                                         in model.signatures.items() if signature.features}
    return features


def _input_specs(servable: Servable) -> dict[str, Any]:
    """Each servable signature's input specs, what decoding a body needs (built once a version)."""
    specs = servable.cache.get("input-specs")
    if specs is None:
        model = predictor_of(servable).model
        specs = servable.cache["input-specs"] = {name: dict(signature.inputs) for name, signature
                                                 in model.signatures.items()}
    return specs
