"""What every front-end does the same way around a call: the bound on calls in progress at once
(--max-concurrent-rpcs, over gRPC and REST together), counting the inference calls that reached a
handler and left it (for the drain), refusing new ones once a drain refuses, timing and recording
every call and ending a failed one through the one status table (`grpc_call`, and `rest_call` in
server.api.http.server), and the client's deadline on the server's clock."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from server import tracing
from server.api.recording import Recorder
from server.core.inference import Inference
from server.core.servables import Servable
from server.core.statistics import RequestTiming
from server.errors import Overloaded

REFUSED = "the server is shutting down; retry on another replica"


@dataclass(slots=True)
class Call:
    """One call's bookkeeping, filled in by its handler as it learns them: the model name the
    client asked for and, once resolved, the version (servable) it is counted against, which it
    holds until it is answered (Servable.hold: a rollout unloads a version only once no call holds
    it); for an inference, where its time went."""

    method: str
    started: float
    name: str = ""
    _servable: Servable | None = None
    timing: RequestTiming | None = None
    """Set by `answered`, once its response is encoded."""
    _handed: float = 0.0
    _inferred: float = 0.0
    _inference: Inference | None = None
    span: Any = None
    """Its trace span (server.tracing), when tracing is on."""
    trace_id: str = ""
    """Its trace id, told to the client (server.tracing.TRACE_ID_TRAILER); "" when not traced."""
    code: str = "OK"
    """The status code name it ended with."""
    message: str = ""

    @property
    def servable(self) -> Servable | None:
        return self._servable

    @servable.setter
    def servable(self, servable: Servable | None) -> None:
        if servable is not None:
            servable.hold()
        if self._servable is not None:
            self._servable.release()
        self._servable = servable

    async def infer(self, work: Awaitable[Inference]) -> Inference:
        """Await the core's `infer(...)`, noting when the decoded request went in and came out."""
        self._handed = time.perf_counter()
        self._inference = await work
        self._inferred = time.perf_counter()
        return self._inference

    def end_span(self) -> None:
        """End its trace span: the version, signature and rows it ran, its code, its queue wait."""
        if not self.span.is_recording():
            return
        servable, result = self._servable, self._inference
        queue = None
        if result is not None:
            queue = (self._handed, self._handed + result.queue_seconds)
        rows = None if result is None else 0  # a control call (or a call failed before the model) has none
        if result is not None and result.outputs:
            first = next(iter(result.outputs.values()))
            rows = int(first.shape[0]) if first.ndim else 1
        tracing.finish_request(self.span, self.code, servable.name if servable else self.name,
                               servable.version if servable else None, result.signature if result else "", rows,
                               queue, self.message)

    def answered(self) -> RequestTiming:
        """Its response is encoded: where its time went, from receipt until now."""
        now = time.perf_counter()
        result = self._inference
        assert result is not None, "answered() before infer()"
        self.timing = RequestTiming(
            queue_seconds=result.queue_seconds,
            input_seconds=self._handed - self.started + result.input_seconds,
            infer_seconds=result.compute_seconds,
            output_seconds=result.output_seconds + now - self._inferred,
            total_seconds=now - self.started,
        )
        return self.timing


T = TypeVar("T")


class Admission:
    """`accepted` and `answered` count inference calls that reached the handler and that left it,
    so a drain can tell that nothing accepted was lost. After `refuse_new()` every new call is
    answered UNAVAILABLE at once and is not counted as accepted."""

    service_name = ""
    """The gRPC service's full name (a request's span is named SERVICE/METHOD)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = self._recorder = recorder
        self.accepted = 0
        self.answered = 0
        self._refusing = False

    @property
    def in_flight(self) -> int:
        return self.accepted - self.answered

    def refuse_new(self) -> None:
        self._refusing = True

    @property
    def refusing(self) -> bool:
        return self._refusing

    def refused(self, method: str, started: float) -> str:
        """Record a call refused because the server is draining (UNAVAILABLE); the message to send."""
        self._recorder.record(method, grpc.StatusCode.UNAVAILABLE, started)
        return REFUSED

    def begin(self, method: str, drained: bool, counted: bool) -> Call | None:
        """A new call, or None when a drain refuses it (`drained`: this method is refused while
        draining; `counted`: an inference call, counted in flight). Ends with `settle`."""
        call = Call(method, time.perf_counter())
        if drained and self._refusing:
            return None
        if counted:
            self.accepted += 1
        return call

    async def settle(self, call: Call, counted: bool, work: Awaitable[T],
                     fail: Callable[[Exception], Awaitable[T]]) -> T:
        """Await the handler's work; record it OK, or end it through `fail` (the front-end's way
        of answering an error); count it answered either way."""
        try:
            result = await work
        except Exception as exc:  # every failure leaves through the status table
            if counted and call.servable is not None:
                call.servable.statistics.request_failed(time.perf_counter() - call.started)
            return await fail(exc)
        finally:
            if counted:
                self.answered += 1
            if call.servable is not None:
                call.servable.release()  # answered (or failing now): the version may retire
        seconds = self.recorder.record(call.method, grpc.StatusCode.OK, call.started, call.servable, call.name)
        if counted and call.servable is not None:
            call.servable.statistics.request_succeeded(seconds, call.timing)
            self.recorder.record_target(call.servable, seconds)
            if call.timing is not None:
                self.recorder.record_runtime(call.method, call.servable, call.timing.infer_seconds)
        return result


S = TypeVar("S", bound=Admission)


def grpc_call(method: str, *, drained: bool = False, counted: bool = False, traced: bool = False) -> Callable[
        [Callable[[S, bytes, grpc.aio.ServicerContext, Call], Awaitable[Any]]],
        Callable[[S, bytes, grpc.aio.ServicerContext], Awaitable[Any]]]:
    """The bookkeeping of a gRPC handler `(self, raw, context, call) -> response`: refused while
    draining (`drained`), counted in flight (`counted`: inference calls, both), timed, recorded,
    and a failure mapped to its status and aborted with it. With --tracing, inference calls and
    those `traced` (the control calls: reload, load, unload) get a span."""

    def decorate(body: Callable[[S, bytes, grpc.aio.ServicerContext, Call], Awaitable[Any]]) -> Callable[
            [S, bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
        @functools.wraps(body)
        async def handler(self: S, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            call = self.begin(method, drained, counted)
            if call is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, self.refused(method, time.perf_counter()))
                raise AssertionError("abort returned")

            async def fail(exc: Exception) -> Any:
                assert call is not None
                code, message = self.recorder.failed(call.method, exc, call.started, call.servable, call.name,
                                                     context.peer())
                call.code, call.message = code.name, message
                await context.abort(code, message)

            if not (tracing.ENABLED and (counted or traced)):
                return await self.settle(call, counted, body(self, raw, context, call), fail)
            call.span = tracing.start_request(f"{self.service_name}/{method}", context.invocation_metadata() or (),
                                              "grpc")
            call.trace_id = tracing.trace_id(call.span)
            with tracing.current(call.span):
                try:
                    return await self.settle(call, counted, body(self, raw, context, call), fail)
                finally:
                    call.end_span()

        return handler

    return decorate


class ConcurrencyLimit:
    """Calls in progress at once on every front-end together, and the bytes of their requests
    (--request-bytes-budget): a call beyond either is refused at once, RESOURCE_EXHAUSTED (REST
    429), counted and logged like any refusal, before its message is decoded or its body read.
    (grpc's own maximum_concurrent_rpcs refuses before our code runs, so those refusals could not
    be counted; and a burst it let through to grpc's pending queue came back CANCELLED.) Counting
    calls alone let 1,024 calls of 64 MiB each in, and a JSON body takes several times its size
    once decoded. A call alone always passes the byte budget."""

    def __init__(self, limit: int, byte_budget: int = 0) -> None:
        self.limit = limit
        self.active = 0
        self.byte_budget = byte_budget
        """0: none."""
        self.held_bytes = 0

    def full(self) -> bool:
        return self.active >= self.limit

    def refusal(self) -> Overloaded:
        return Overloaded(f"{self.active} requests are in progress; the limit is {self.limit} "
                          f"(--max-concurrent-rpcs); retry later")

    def bytes_refusal(self, size: int) -> Overloaded | None:
        """Why a request of `size` bytes may not be held now, or None (then `hold` it)."""
        if not self.byte_budget or not self.held_bytes or self.held_bytes + size <= self.byte_budget:
            return None
        return Overloaded(f"requests in progress hold {self.held_bytes} bytes and this one brings {size}; the "
                          f"budget is {self.byte_budget} bytes (--request-bytes-budget); retry later")

    def hold(self, size: int) -> None:
        self.held_bytes += size

    def release(self, size: int) -> None:
        self.held_bytes -= size


GrpcBehavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def limited(behavior: GrpcBehavior, limit: ConcurrencyLimit, recorder: Recorder, method: str) -> GrpcBehavior:
    """A gRPC handler within the concurrency limit: refused RESOURCE_EXHAUSTED (counted) beyond it."""

    async def handler(raw: Any, context: grpc.aio.ServicerContext) -> Any:
        size = 2 * len(raw) if isinstance(raw, bytes) else 0  # the message and its decoded tensors
        refusal = limit.refusal() if limit.full() else limit.bytes_refusal(size)
        if refusal is not None:
            code, message = recorder.failed(method, refusal, time.perf_counter(), peer=context.peer())
            await context.abort(code, message)
        limit.active += 1
        limit.hold(size)
        try:
            return await behavior(raw, context)
        finally:
            limit.active -= 1
            limit.release(size)

    return handler


def add_limited_handlers(server: grpc.aio.Server, service: Any, behaviors: Mapping[str, tuple[GrpcBehavior, Any]],
                         recorder: Recorder, limit: ConcurrencyLimit) -> None:
    """Register a service's methods (method -> (handler, response message class)), each within the
    concurrency limit; the names must be the service descriptor's, all of them."""
    handlers = {
        method: grpc.unary_unary_rpc_method_handler(limited(behavior, limit, recorder, method),
                                                    response_serializer=response.SerializeToString)
        for method, (behavior, response) in behaviors.items()
    }
    assert set(handlers) == {m.name for m in service.methods}, "handlers and protos disagree"
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The client's deadline on time.monotonic's clock, or None without one."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining
