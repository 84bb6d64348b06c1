"""server.core.lifecycle.plan and server.core.servables.Registry: which versions load and unload, and what a
request resolves to, exactly."""

from __future__ import annotations

import pytest

from server.core.lifecycle import plan, retry_delay
from server.core.model_config import ModelSource, VersionPolicy
from server.core.servables import Model, Registry, Servable, State
from server.errors import InvalidInput, NotFound, Unavailable

A, L, E, U = State.AVAILABLE, State.LOADING, State.END, State.UNLOADING


def test_a_new_version_loads_beside_the_old_which_stays() -> None:
    assert plan({2}, {1: A}, ()) == ([2], [])


def test_the_old_version_unloads_once_the_new_is_available() -> None:
    assert plan({2}, {1: A, 2: A}, ()) == ([], [1])


def test_a_failed_new_version_leaves_the_old_serving_and_retries_only_when_due() -> None:
    assert plan({2}, {1: A, 2: E}, ()) == ([], [])
    assert plan({2}, {1: A, 2: E}, {2}) == ([2], [])


def test_an_emptied_folder_keeps_what_serves() -> None:
    assert plan(set(), {1: A}, ()) == ([], [])


def test_loads_go_highest_first_and_unloads_only_non_aspired_available() -> None:
    assert plan({1, 2, 3}, {}, ()) == ([3, 2, 1], [])
    assert plan({3, 4}, {2: A, 3: A, 1: E, 5: L}, ()) == ([4], [2])


def test_retry_back_off_doubles_to_a_minute() -> None:
    assert [retry_delay(n) for n in (1, 2, 3, 6, 7, 20)] == [1.0, 2.0, 4.0, 32.0, 60.0, 60.0]


def registry() -> Registry:
    reg = Registry()
    reg.starting = False
    model = Model(ModelSource("m", "/m", VersionPolicy("all"), {"stable": 1, "canary": 3, "next": 4}))
    model.versions = {v: Servable("m", v, f"/m/{v}", state=s) for v, s in {1: A, 2: U, 3: A, 4: L, 5: E}.items()}
    model.refresh()
    reg.models["m"] = model
    return reg


def test_resolution_by_default_version_and_label() -> None:
    reg = registry()
    assert reg.resolve("m").version == 3
    assert reg.resolve("m", 1).version == 1
    assert reg.resolve("m", label="stable").version == 1
    assert reg.resolve("m", label="canary").version == 3


@pytest.mark.parametrize(("args", "error", "message"), [
    (("",), InvalidInput, "model_spec.name is empty; models served: m"),
    (("x",), NotFound, "model 'x' not found; models served: m"),
    (("m", 2), NotFound, "model 'm' version 2 not found; available versions: 1, 3"),
    (("m", 9), NotFound, "model 'm' version 9 not found; available versions: 1, 3"),
    (("m", 5), NotFound, "model 'm' version 5 not found"),
    (("m", 4), Unavailable, "model 'm' version 4 is loading; retry shortly"),
    (("m", None, "beta"), NotFound, "version label 'beta' of model 'm' not found; labels: canary=3, next=4, stable=1"),
    (("m", None, "next"), Unavailable, "model 'm' version 4 (label 'next') is loading"),
])
def test_resolution_errors_name_what_was_asked_and_what_exists(
    args: tuple[object, ...], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as caught:
        registry().resolve(*args)  # type: ignore[arg-type]
    assert str(caught.value).startswith(message)


def test_while_starting_what_is_missing_is_unavailable_not_not_found() -> None:
    reg = Registry()
    with pytest.raises(Unavailable, match=r"model 'm' is loading \(the server is starting\)"):
        reg.resolve("m")
    reg.models["m"] = Model(ModelSource("m", "/m"))
    with pytest.raises(Unavailable, match="model 'm' is loading"):
        reg.resolve("m")
    reg.starting = False
    with pytest.raises(NotFound, match="model 'x' not found"):
        reg.resolve("x")


def test_no_available_version() -> None:
    reg = registry()
    model = reg.models["m"]
    for servable in model.versions.values():
        servable.state = E
    model.versions[5].error = (15, "DecodeError: bad")
    model.refresh()
    with pytest.raises(NotFound, match="model 'm' has no available version; version 5 failed to load: DecodeError"):
        reg.resolve("m")
    model.versions[4].state = L
    with pytest.raises(Unavailable, match="model 'm' is loading"):
        reg.resolve("m")
