"""Triton's model repository extension over TensorFlow Serving's layout: which models the server
could serve, which it serves, and loading or unloading one while the others keep serving.

With --model-repository DIR, every subfolder of DIR is a model named after it, its versions in TF
Serving's layout (DIR/NAME/1/saved_model.pb). --model-control-mode says what is served: `none`,
every model there at start and no load or unload; `explicit`, only what --load-model names and
load calls ask for. Without a repository the configured models are the repository (index only).

A load or an unload is a new model list through the lifecycle (server.core.lifecycle), as a
config reload is: the other models are untouched, an unloaded model leaves resolution at once and
its queued requests are still answered. A load that leaves the model with no AVAILABLE version is
undone, and fails naming why. Who may call these, and from where paths may come, is the front
end's business (server.api.control).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from server.core.lifecycle import Lifecycle
from server.core.model_config import ConfigError, ModelSource
from server.core.servables import Registry, State
from server.errors import FailedPrecondition, InvalidInput, NotFound, Unavailable

NONE, EXPLICIT = "none", "explicit"
CONTROL_MODES = (NONE, EXPLICIT)

STATE_NAMES = {State.START: "LOADING", State.LOADING: "LOADING", State.AVAILABLE: "READY",
               State.UNLOADING: "UNLOADING", State.END: "UNAVAILABLE"}
"""Triton's model states for TF Serving's."""


@dataclass(frozen=True)
class IndexEntry:
    name: str
    version: str
    """Empty for a model that has no version loaded or tried."""
    state: str
    reason: str


def folder_models(root: str) -> list[str]:
    """The model names of a repository folder: its subfolders, hidden ones skipped."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as exc:
        raise NotFound(f"the model repository {root} cannot be read: {exc.strerror or exc}") from None
    return [e.name for e in entries if not e.name.startswith(".") and e.is_dir()]


def repository_sources(root: str, mode: str, load: Sequence[str]) -> list[ModelSource]:
    """The start-up models of a repository: all of them (mode none, or --load-model '*'), or the
    ones --load-model names. ConfigError (the server exits 2) names a folder that is not there."""
    if not os.path.isdir(root):
        raise ConfigError(f"--model-repository {root} is not a folder")
    there = folder_models(root)
    names = there if mode == NONE or "*" in load else list(dict.fromkeys(load))
    missing = [n for n in names if n not in there]
    if missing:
        raise ConfigError(f"--load-model {missing[0]}: no such model folder in {root}; "
                          f"there: {', '.join(there) or 'none'}")
    return [ModelSource(name=n, base_path=os.path.join(root, n)) for n in names]


def check_model_name(name: str) -> None:
    """A model name that addresses a subfolder, and nothing else (no separators, no '..')."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name or len(name) > 255:
        raise InvalidInput(f"model name '{name[:80]}' is not a folder name of the model repository")


class Repository:
    def __init__(self, registry: Registry, lifecycle: Callable[[], Lifecycle | None], root: str | None,
                 mode: str) -> None:
        """`lifecycle` returns None until the model worker has started; `root` is --model-repository."""
        self._registry = registry
        self._lifecycle = lifecycle
        self.root = root
        self.mode = mode
        self._lock = asyncio.Lock()
        """One change at a time: each reads the model list and applies a new one."""

    def index(self, ready_only: bool) -> list[IndexEntry]:
        """Every model there is: each version known of a configured one, with its state and the
        error of its last failed load; a repository model not loaded, once, UNAVAILABLE."""
        entries = []
        models = self._registry.models
        for name in sorted(models):
            versions = models[name].versions
            for version in sorted(versions):
                servable = versions[version]
                state = STATE_NAMES[servable.state]
                reason = servable.error[1] if servable.error else ("unloaded" if state == "UNAVAILABLE" else
                                                                   servable.target_note())
                entries.append(IndexEntry(name, str(version), state, reason))
            if not versions:
                entries.append(IndexEntry(name, "", "UNAVAILABLE", "no version folder its policy serves"))
        if self.root is not None:
            entries += [IndexEntry(n, "", "UNAVAILABLE", "unloaded") for n in folder_models(self.root)
                        if n not in models]
        if ready_only:
            entries = [e for e in entries if e.state == "READY"]
        return sorted(entries, key=lambda e: (e.name, int(e.version) if e.version else -1))

    def source(self, name: str) -> ModelSource:
        """The repository's model `name` with its default policy (the highest version)."""
        self._check_explicit("load")
        assert self.root is not None
        check_model_name(name)
        path = os.path.join(self.root, name)
        if not os.path.isdir(path):
            raise NotFound(f"model '{name}' is not in the model repository {self.root}; models there: "
                           f"{', '.join(folder_models(self.root)) or 'none'}")
        return ModelSource(name=name, base_path=path)

    async def load(self, source: ModelSource) -> None:
        """Serve this model too (again, with its source's policy, if it is served already); once
        this returns it has an AVAILABLE version. FailedPrecondition, and nothing changed, if it
        does not become available."""
        lifecycle = self._started()
        async with self._lock:
            before = lifecycle.sources()
            others = [s for s in before if s.name != source.name]
            problems = await lifecycle.apply([*others, source])
            if problems:
                await lifecycle.apply(before)
                raise FailedPrecondition(f"model '{source.name}' failed to load: {'; '.join(problems)}")

    async def unload(self, name: str) -> None:
        """Stop serving a model; returns once its queued requests are answered and it is freed."""
        self._check_explicit("unload")
        check_model_name(name)
        lifecycle = self._started()
        async with self._lock:
            before = lifecycle.sources()
            if name not in {s.name for s in before}:
                raise NotFound(f"model '{name}' is not loaded; loaded: {', '.join(s.name for s in before) or 'none'}")
            await lifecycle.apply([s for s in before if s.name != name])

    def _check_explicit(self, what: str) -> None:
        if self.root is None or self.mode != EXPLICIT:
            raise FailedPrecondition(f"this server does not {what} models on request: start it with "
                                     f"--model-repository DIR --model-control-mode explicit")

    def _started(self) -> Lifecycle:
        lifecycle = self._lifecycle()
        if lifecycle is None:
            raise Unavailable("the server is starting; retry shortly")
        return lifecycle
