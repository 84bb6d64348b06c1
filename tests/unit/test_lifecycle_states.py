"""server.core.lifecycle.Lifecycle driven with a fake model worker: exact states and worker calls
for load, a failed load and its back-off, unload only after a successor is AVAILABLE, the drain
of a removed model, and a worker that dies mid-batch. No TensorFlow, no processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from server.config import parse_settings
from server.core.assembly import Tensors, concat_rows
from server.core.batching_policy import BatchingPolicy
from server.core.inference import infer
from server.core.lifecycle import UNAVAILABLE_CODE, Lifecycle
from server.core.model_config import ModelSource, VersionPolicy
from server.core.model_process import LoadError
from server.core.servables import Registry, State
from server.core.signatures import ModelInfo, Signature, TensorSpec
from server.core.worker_protocol import Done, Loaded
from server.errors import NotFound, Unavailable

POLICY = BatchingPolicy(max_batch_size=8, batch_timeout_s=0.0, max_inflight_batches=1, max_queued_rows=100)
SPEC = TensorSpec(np.dtype(np.float32), (None, 2))


def info(name: str, version: int) -> ModelInfo:
    signature = Signature("serving_default", {"x": SPEC}, {"y": SPEC})
    return ModelInfo(name, version, {"serving_default": signature}, {})


class FakeWorker:
    """Records every call as (what, model, version[, rows]) and the states of the model's versions
    at that moment; loads fail as told; batches can be held at a gate or fail as the worker dying."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.calls: list[tuple[object, ...]] = []
        self.states_at: list[dict[int, State]] = []
        self.fail_loads: dict[int, Exception] = {}
        self.gate: asyncio.Event | None = None
        self.alive = True
        self.allowed_by: list[str | None] = []
        """What each load was told lets a failed warm-up pass (Load.warm_up_failure_allowed_by)."""
        self._ids: dict[int, tuple[str, int]] = {}

    def _note(self, *call: object) -> None:
        self.calls.append(call)
        model = self.registry.models.get(str(call[1]))
        self.states_at.append({} if model is None else {v: s.state for v, s in model.versions.items()})

    def _gone(self) -> None:
        if not self.alive:
            raise Unavailable("the model worker is gone (exit code -9); retry on another replica")

    async def load(self, servable: int, name: str, version: int, path: str,
                   warm_up_sizes: tuple[int, ...], max_inflight: int,
                   warm_up_failure_allowed_by: str | None = None, max_batch_rows: int = 0,
                   allowed_batch_sizes: tuple[int, ...] = (), measure_cost: bool = False) -> Loaded:
        self._note("load", name, version)
        self.allowed_by.append(warm_up_failure_allowed_by)
        self._gone()
        failure = self.fail_loads.pop(version, None)
        if failure is not None:
            raise failure
        self._ids[servable] = (name, version)
        return Loaded(servable, info(name, version), {}, 0.01)

    async def unload(self, servable: int) -> None:
        self._note("unload", *self._ids[servable])
        self._gone()

    async def run(self, servable: int, signature: str, parts: Sequence[Tensors], rows: int = 1,
                  counted_rows: int = 1) -> Done:
        batch = concat_rows(list(parts))
        rows = int(batch["x"].shape[0])
        self._note("run", *self._ids[servable], rows)
        if self.gate is not None:
            await self.gate.wait()
        self._gone()
        return Done(0, {"y": batch["x"] * 2}, 0.001, {}, (rows,))


def folder(base: Path, *versions: int) -> None:
    for version in versions:
        (base / str(version)).mkdir(parents=True, exist_ok=True)
        (base / str(version) / "saved_model.pb").write_bytes(b"")


def setup(tmp_path: Path) -> tuple[Lifecycle, FakeWorker, Registry, ModelSource]:
    registry = Registry()
    registry.starting = False
    worker = FakeWorker(registry)
    lifecycle = Lifecycle(parse_settings([]), worker, registry, 1, POLICY)
    return lifecycle, worker, registry, ModelSource("m", str(tmp_path / "m"), VersionPolicy("latest", 1))


def states(registry: Registry, name: str = "m") -> dict[int, State]:
    return {v: s.state for v, s in registry.models[name].versions.items()}


async def predict(registry: Registry, name: str = "m") -> np.ndarray:
    result = await infer(registry.resolve(name), "", {"x": np.ones((3, 2), np.float32)}, (), None)
    return result.outputs["y"]


async def held_request(worker: FakeWorker, registry: Registry) -> asyncio.Task[np.ndarray]:
    """A 3-row request whose batch has reached the worker and is held there until worker.gate opens."""
    worker.gate = asyncio.Event()
    request = asyncio.create_task(predict(registry))
    while worker.calls[-1][0] != "run" or worker.calls[-1][3] != 3:
        await asyncio.sleep(0)
    return request


def test_a_version_loads_warms_its_batch_path_and_serves(tmp_path: Path) -> None:
    async def go() -> None:
        lifecycle, worker, registry, source = setup(tmp_path)
        folder(Path(source.base_path), 1)
        assert await lifecycle.apply([source]) == []
        assert worker.calls == [("load", "m", 1), ("run", "m", 1, 1)]  # the warm-up batch: 1 row
        assert states(registry) == {1: State.AVAILABLE}
        assert (await predict(registry)).tolist() == [[2.0, 2.0]] * 3
        assert worker.calls[-1] == ("run", "m", 1, 3)
        assert lifecycle.every_model_available()

    asyncio.run(go())


def test_a_failed_load_is_retried_only_after_its_back_off(tmp_path: Path) -> None:
    async def go() -> None:
        lifecycle, worker, registry, source = setup(tmp_path)
        folder(Path(source.base_path), 1)
        worker.fail_loads[1] = LoadError(3, "warm-up failed: bad kernel")
        problems = await lifecycle.apply([source])
        assert problems == ["'m': warm-up failed: bad kernel"]
        servable = registry.models["m"].versions[1]
        assert (servable.state, servable.error, servable.failures) == (State.END, (3, "warm-up failed: bad kernel"), 1)
        with pytest.raises(NotFound, match="failed to load"):
            registry.resolve("m")
        await lifecycle.apply([source])  # before the 1 s back-off: not tried again
        assert [c for c in worker.calls if c[0] == "load"] == [("load", "m", 1)]
        worker.fail_loads[1] = LoadError(3, "still bad")
        servable.retry_at = 0.0  # the back-off has passed
        await lifecycle.apply([source])
        again = registry.models["m"].versions[1]
        assert (again.state, again.failures) == (State.END, 2)
        assert 1.5 < again.retry_at - time.monotonic() <= 2.0  # the second failure waits 2 s
        again.retry_at = 0.0
        await lifecycle.apply([source])
        assert states(registry) == {1: State.AVAILABLE}
        assert registry.models["m"].versions[1].error is None

    asyncio.run(go())


class FileWarmUp:
    """A warm-up hook that covers the version folders holding a file named 'warmup'."""

    def covers(self, path: str) -> bool:
        return (Path(path) / "warmup").is_file()

    async def __call__(self, servable: object) -> None:
        return None


def test_a_failed_generated_warm_up_fails_the_load_unless_a_warmup_file_or_the_flag_allows_it(
        tmp_path: Path) -> None:
    base = tmp_path / "m"
    folder(base, 1, 2)
    (base / "2" / "warmup").write_bytes(b"")
    source = ModelSource("m", str(base), VersionPolicy("all", 0))

    async def loads(flags: list[str], warm_up: FileWarmUp | None) -> list[str | None]:
        registry = Registry()
        registry.starting = False
        worker = FakeWorker(registry)
        await Lifecycle(parse_settings(flags), worker, registry, 1, POLICY, warm_up=warm_up).apply([source])
        return worker.allowed_by  # versions load highest first

    async def go() -> tuple[list[str | None], list[str | None]]:
        return await loads([], FileWarmUp()), await loads(["--no-strict-warm-up"], FileWarmUp())

    strict, lenient = asyncio.run(go())
    assert strict == ["its warmup file decides: its requests run next, and a failure fails the load", None]
    assert lenient == ["--no-strict-warm-up", "--no-strict-warm-up"]


def test_the_old_version_unloads_only_once_its_successor_is_available(tmp_path: Path) -> None:
    async def go() -> None:
        lifecycle, worker, registry, source = setup(tmp_path)
        base = Path(source.base_path)
        folder(base, 1)
        await lifecycle.apply([source])
        folder(base, 2)
        worker.fail_loads[2] = LoadError(3, "corrupt")
        await lifecycle.apply([source])
        assert states(registry) == {1: State.AVAILABLE, 2: State.END}  # the corrupt one left 1 serving
        assert registry.resolve("m").version == 1
        registry.models["m"].versions[2].retry_at = 0.0
        worker.calls.clear()
        worker.states_at.clear()
        await lifecycle.apply([source])
        assert worker.calls == [("load", "m", 2), ("run", "m", 2, 1), ("unload", "m", 1)]
        assert worker.states_at[-1] == {1: State.UNLOADING, 2: State.AVAILABLE}
        assert states(registry) == {1: State.END, 2: State.AVAILABLE}
        assert registry.resolve("m").version == 2

    asyncio.run(go())


def test_a_removed_model_leaves_resolution_at_once_and_finishes_its_requests(tmp_path: Path) -> None:
    async def go() -> None:
        lifecycle, worker, registry, source = setup(tmp_path)
        folder(Path(source.base_path), 1)
        await lifecycle.apply([source])
        request = await held_request(worker, registry)
        applying = asyncio.create_task(lifecycle.apply([]))
        await asyncio.sleep(0.01)
        with pytest.raises(NotFound):
            registry.resolve("m")
        assert not any(c[0] == "unload" for c in worker.calls)  # its batch still runs
        worker.gate.set()
        assert (await request).tolist() == [[2.0, 2.0]] * 3
        await applying
        assert worker.calls[-1] == ("unload", "m", 1)

    asyncio.run(go())


def test_a_worker_that_dies_mid_batch_fails_the_batch_and_later_loads(tmp_path: Path) -> None:
    async def go() -> None:
        lifecycle, worker, registry, source = setup(tmp_path)
        base = Path(source.base_path)
        folder(base, 1)
        await lifecycle.apply([source])
        request = await held_request(worker, registry)
        worker.alive = False
        worker.gate.set()
        with pytest.raises(Unavailable, match="model worker is gone"):
            await request
        assert not lifecycle.every_model_available()
        folder(base, 2)
        await lifecycle.apply([source])
        failed = registry.models["m"].versions[2]
        assert (failed.state, failed.error[0] if failed.error else None) == (State.END, UNAVAILABLE_CODE)
        assert states(registry) == {1: State.AVAILABLE, 2: State.END}

    asyncio.run(go())


def test_a_retiring_version_waits_for_the_requests_that_hold_it(tmp_path: Path) -> None:
    """A request resolved version 1, then awaited (its body decoding) while version 2 rolled in:
    version 1 leaves resolution, but is drained and unloaded only once that request is answered."""

    async def go() -> None:
        lifecycle, worker, registry, source = setup(tmp_path)
        base = Path(source.base_path)
        folder(base, 1)
        await lifecycle.apply([source])
        old = registry.resolve("m")
        old.hold()
        folder(base, 2)
        rolling = asyncio.create_task(lifecycle.apply([source]))
        while states(registry) != {1: State.UNLOADING, 2: State.AVAILABLE}:
            await asyncio.sleep(0.001)
        assert registry.resolve("m").version == 2
        await asyncio.sleep(0.05)
        result = await infer(old, "", {"x": np.ones((3, 2), np.float32)}, (), None)  # the held request goes on
        assert result.servable is old and result.outputs["y"].tolist() == [[2.0, 2.0]] * 3
        assert ("unload", "m", 1) not in worker.calls
        old.release()
        await asyncio.wait_for(rolling, 5)
        assert ("unload", "m", 1) in worker.calls and states(registry) == {1: State.END, 2: State.AVAILABLE}

    asyncio.run(go())
