"""The Open Inference Protocol's REST API (KServe v2), as tritonclient's HTTP client speaks it:

    GET  /v2                                          server metadata
    GET  /v2/health/live, /v2/health/ready            200 when true, 400 when not (the protocol's rule)
    GET  /v2/models/NAME[/versions/V]                 model metadata
    GET  /v2/models/NAME[/versions/V]/ready           200 when ready, 400 when not
    POST /v2/models/NAME[/versions/V]/infer           JSON tensors, or Triton's binary extension
    GET  /v2/models/NAME[/versions/V]/config          Triton's model configuration
    GET  /v2/models[/NAME[/versions/V]]/stats         Triton's statistics
    POST /v2/repository/index                         Triton's model repository: what there is
    POST /v2/repository/models/NAME/load|unload       ... and changing what is served (guarded)

Like its gRPC twin (server.api.v2.grpc_service) it only translates, through the same Predictor. A deadline comes
from the Grpc-Timeout header or from Triton's `timeout` parameter (microseconds), whichever ends first.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from server.api import request_timing
from server.api.admission import Call
from server.api.control import ControlPlane, rest_credentials
from server.api.http import json_codec
from server.api.http import server as rest
from server.api.http.body import BodyDecoder, read_body
from server.api.recording import Recorder
from server.api.v2 import model as v2_model
from server.api.v2 import rest_json as v2_json
from server.api.v2 import triton_model
from server.config import server_version
from server.core.inference import infer
from server.core.repository import Repository
from server.core.servables import Registry, Servable
from server.core.statistics import PeerStatistics
from server.errors import InvalidInput

PROTOCOL = "v2-rest"
CONTROL_BODY_BYTES = 1 << 20
"""Largest body of an index, load or unload call: a model configuration, not tensors."""


class V2Rest(rest.RestFrontEnd):
    def __init__(self, registry: Registry, max_body_bytes: int, ready: Callable[[], bool],
                 decoder: BodyDecoder, repository: Repository, control: Callable[[], ControlPlane],
                 default_timeout_s: float | None = None, peers: PeerStatistics | None = None) -> None:
        """`ready`: whether the server as a whole is ready, as health says; `control`: who may
        load and unload models; `peers`: the other front-end processes' statistics."""
        self._peers = peers
        super().__init__(Recorder(registry, PROTOCOL), default_timeout_s)
        self._registry = registry
        self._repository = repository
        self._control = control
        self._max_body_bytes = max_body_bytes
        self._decoder = decoder
        self._ready = ready
        self._metadata = {"name": v2_model.SERVER_NAME, "version": server_version(),
                          "extensions": triton_model.EXTENSIONS}

    def routes(self) -> list[web.RouteDef]:
        model = "/v2/models/{name}"
        version = model + "/versions/{version}"
        return [
            web.get("/v2", self.server_metadata),
            web.get("/v2/health/live", self.live),
            web.get("/v2/health/ready", self.server_ready),
            web.get("/v2/models/stats", self.model_statistics),  # before the model named "stats"
            *(route for base in (model, version) for route in (
                web.get(base, self.model_metadata),
                web.get(base + "/ready", self.model_ready),
                web.post(base + "/infer", self.infer),
                web.get(base + "/config", self.model_config),
                web.get(base + "/stats", self.model_statistics),
            )),
            web.post("/v2/repository/index", self.repository_index),
            web.post("/v2/repository/models/{name}/load", self.repository_model_load),
            web.post("/v2/repository/models/{name}/unload", self.repository_model_unload),
        ]

    async def server_metadata(self, request: web.Request) -> web.StreamResponse:
        return rest.json_response(self._metadata)

    async def live(self, request: web.Request) -> web.StreamResponse:
        return rest.json_response({"live": True})

    async def server_ready(self, request: web.Request) -> web.StreamResponse:
        ready = self._ready() and not self.refusing
        return rest.json_response({"ready": ready}, 200 if ready else 400)

    def _resolve(self, request: web.Request, call: Call) -> Servable:
        call.name = request.match_info["name"]
        version = v2_model.parse_version(request.match_info.get("version", ""), "version")
        return self._registry.resolve(call.name, version)

    @rest.rest_call("ModelReady")
    async def model_ready(self, request: web.Request, call: Call) -> web.StreamResponse:
        """Ready or not; only a malformed version is an error (an unknown model is not ready)."""
        name = call.name = request.match_info["name"]
        ready = v2_model.is_ready(self._registry, name, request.match_info.get("version", "")) and not self.refusing
        return rest.json_response({"name": name, "ready": ready}, 200 if ready else 400)

    @rest.rest_call("ModelMetadata")
    async def model_metadata(self, request: web.Request, call: Call) -> web.StreamResponse:
        call.servable = servable = self._resolve(request, call)
        return rest.json_response(v2_model.metadata(self._registry, servable))

    @rest.rest_call("ModelInfer", drained=True, counted=True)
    async def infer(self, request: web.Request, call: Call) -> web.StreamResponse:
        call.servable = servable = self._resolve(request, call)
        deadline = self.deadline(request)
        raw = await read_body(request, self._max_body_bytes)
        json_length = request.headers.get(v2_json.HEADER_LENGTH)
        body = await self._decoder.decode(v2_json.json_bytes(raw, json_length), v2_json.decode_infer_body,
                                          raw, json_length, self._max_body_bytes)
        if body.timeout_us is not None:
            until = time.monotonic() + body.timeout_us / 1e6
            deadline = until if deadline is None else min(deadline, until)
        result = await call.infer(infer(servable, body.signature_name, body.inputs, body.outputs, deadline))
        encoded, header_length = v2_json.encode_infer(servable.name, str(servable.version), body, result.outputs,
                                                      request_timing.v2_parameters(result))
        timing = {request_timing.SERVER_TIMING: request_timing.server_timing(call.answered())}
        if header_length is None:
            return web.Response(body=encoded, content_type="application/json", headers=timing)
        return web.Response(body=encoded, content_type="application/octet-stream",
                            headers={v2_json.HEADER_LENGTH: str(header_length), **timing})

    @rest.rest_call("ModelConfig")
    async def model_config(self, request: web.Request, call: Call) -> web.StreamResponse:
        call.servable = servable = self._resolve(request, call)
        return rest.json_response(triton_model.config(self._registry, servable))

    @rest.rest_call("ModelStatistics")
    async def model_statistics(self, request: web.Request, call: Call) -> web.StreamResponse:
        call.name = request.match_info.get("name", "")
        return rest.json_response(await triton_model.statistics(self._registry, call.name,
                                                                request.match_info.get("version", ""), self._peers))

    @rest.rest_call("RepositoryIndex")
    async def repository_index(self, request: web.Request, call: Call) -> web.StreamResponse:
        body = await self._json_body(request)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput("'ready' must be true or false")
        return rest.json_response(triton_model.index(self._repository, ready))

    @rest.rest_call("RepositoryModelLoad", traced=True)
    async def repository_model_load(self, request: web.Request, call: Call) -> web.StreamResponse:
        return await self._change(request, call, lambda name, parameters: triton_model.load(
            self._repository, self._control(), name, parameters))

    @rest.rest_call("RepositoryModelUnload", traced=True)
    async def repository_model_unload(self, request: web.Request, call: Call) -> web.StreamResponse:
        return await self._change(request, call, lambda name, parameters: triton_model.unload(
            self._repository, name, parameters))

    async def _change(self, request: web.Request, call: Call,
                      work: Callable[[str, dict[str, Any]], Awaitable[None]]) -> web.StreamResponse:
        """A call that changes the served models: authorized before its body is read
        (server.api.control), logged with its outcome."""
        control = self._control()
        peer = request.remote or ""
        caller = control.authorize(call.method, peer, *rest_credentials(
            request.headers.get("Authorization"), request.transport))
        call.name = request.match_info["name"]
        try:
            parameters = (await self._json_body(request)).get("parameters", {})
            if not isinstance(parameters, dict):
                raise InvalidInput("'parameters' must be a JSON object")
            await work(call.name, parameters)
        except Exception as exc:
            control.done(caller, call.method, f"failed: {exc}")
            raise
        control.done(caller, call.method, f"OK: model {call.name}")
        return rest.json_response({})

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        """A small JSON object body; empty is {}."""
        raw = await read_body(request, min(self._max_body_bytes, CONTROL_BODY_BYTES), "a control call's body")
        if not raw.strip():
            return {}
        body = json_codec.loads(raw)
        if not isinstance(body, dict):
            raise InvalidInput("the body must be a JSON object")
        return body
