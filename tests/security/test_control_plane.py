"""Model management is closed unless opened: off by default (PERMISSION_DENIED naming the flag);
when on, a call needs a token, and base paths must resolve inside a model root. Before issue 30,
anyone reaching the port loaded any folder holding a SavedModel (and with it, code that read
/etc/shadow with the server's rights), or removed every other model."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from protos.tensorflow_serving import (
    get_model_status_pb2,
    model_management_pb2,
    model_server_config_pb2,
    model_service_pb2_grpc,
)
from tests.integration.conftest import ServerProcess, start_server
from tests.security.conftest import LOOPBACK, config_file

TOKEN = "9b1c2f0e-token-of-the-tests"


def reload(target: str, models: dict[str, Path], token: str | None = None) -> tuple[str, str]:
    config = model_server_config_pb2.ModelServerConfig()
    for name, base in models.items():
        config.model_config_list.config.add(name=name, base_path=str(base), model_platform="tensorflow")
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else None
    with grpc.insecure_channel(target) as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)
        try:
            stub.HandleReloadConfigRequest(model_management_pb2.ReloadConfigRequest(config=config), timeout=60,
                                           metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details()
    return "OK", ""


def versions(target: str, name: str) -> str:
    with grpc.insecure_channel(target) as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)
        request = get_model_status_pb2.GetModelStatusRequest()
        request.model_spec.name = name
        try:
            response = stub.GetModelStatus(request, timeout=10)
        except grpc.RpcError as exc:
            return exc.code().name
    return ",".join(f"{s.version}:{s.state}" for s in response.model_version_status)


@pytest.fixture(scope="module")
def places(security_models: Path, model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Path]:
    """An evil SavedModel outside the model root (under /tmp), a symlink to it from inside the
    root, and a good model inside the root, not yet served."""
    outside = tmp_path_factory.mktemp("outside")
    evil = outside / "evil"
    shutil.copytree(model_dirs["echo"], evil)
    (security_models / "link").symlink_to(evil)
    shutil.copytree(model_dirs["echo"], security_models / "echo")
    return {"root": security_models, "evil": evil, "link": security_models / "link",
            "missing": outside / "nothing-here", "good": security_models / "echo"}


@pytest.fixture(scope="module")
def managed(places: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("managed")
    tokens = folder / "tokens"
    tokens.write_text(f"# who may manage models\nci-admin {TOKEN}\n")
    config = config_file(folder / "models.config", {"demo": places["root"] / "demo"})
    server = start_server(["--model-config-file", str(config), "--enable-model-management", "--admin-token-file",
                           str(tokens), "--drain-delay-s", "0", *LOOPBACK], folder / "server.log")
    yield server
    server.stop()


def test_management_is_off_by_default(attack_server: ServerProcess, places: dict[str, Path]) -> None:
    offset = len(attack_server.log())
    for token in (None, TOKEN):
        code, details = reload(attack_server.target, {"evil": places["evil"]}, token)
        assert code == "PERMISSION_DENIED", (code, details)
        assert "--enable-model-management" in details
    assert versions(attack_server.target, "evil") == "NOT_FOUND"
    assert versions(attack_server.target, "str").startswith("1:30"), "the other models stay"
    log = attack_server.log()[offset:]
    assert "model management HandleReloadConfigRequest from ipv4:127.0.0.1:" in log
    assert "denied: model management is off" in log


def test_a_call_needs_a_valid_token(managed: ServerProcess, places: dict[str, Path]) -> None:
    offset = len(managed.log())
    for token in (None, "wrong", TOKEN[:-1]):
        code, details = reload(managed.target, {"demo": places["root"] / "demo", "echo": places["good"]}, token)
        assert code == "UNAUTHENTICATED", (token, code, details)
    assert versions(managed.target, "echo") == "NOT_FOUND"
    log = managed.log()[offset:]
    assert log.count("denied: no credential") == 1 and log.count("denied: invalid token") == 2
    assert TOKEN[:-1] not in log


def test_base_paths_outside_the_roots_are_refused_alike_whether_they_exist_or_not(
        managed: ServerProcess, places: dict[str, Path]) -> None:
    answers = {}
    for place in ("evil", "link", "missing"):
        code, details = reload(managed.target, {"demo": places["root"] / "demo", "m": places[place]}, TOKEN)
        assert code == "INVALID_ARGUMENT", (place, code, details)
        answers[place] = details.replace(str(places[place]), "PATH")
    assert len(set(answers.values())) == 1, answers
    assert "is not inside a model root (--model-root: " in answers["evil"]
    assert versions(managed.target, "m") == "NOT_FOUND"
    assert versions(managed.target, "demo").startswith("1:30")


def test_the_right_token_loads_a_model_inside_a_root_and_everything_is_logged(
        managed: ServerProcess, places: dict[str, Path]) -> None:
    offset = len(managed.log())
    code, details = reload(managed.target, {"demo": places["root"] / "demo", "echo": places["good"]}, TOKEN)
    assert code == "OK", details
    assert versions(managed.target, "echo") == "1:30"
    # A config without a model removes it: the unload is logged properly (it raised a logging error).
    code, details = reload(managed.target, {"echo": places["good"]}, TOKEN)
    assert code == "OK", details
    log = managed.log()[offset:]
    assert "model management HandleReloadConfigRequest from ipv4:127.0.0.1:" in log
    assert "by ci-admin: OK: serving models demo, echo" in log
    assert "unloaded model=demo version=1" in log
    assert "Logging error" not in managed.log() and TOKEN not in managed.log()


def test_a_batching_change_for_a_loaded_model_is_refused_naming_the_field(
        managed: ServerProcess, places: dict[str, Path]) -> None:
    """batching_parameters take effect when a version loads: changing them under a loaded version
    is refused, not silently ignored until the next version."""
    code, details = reload(managed.target, {"echo": places["good"]}, TOKEN)
    assert code == "OK", details
    config = model_server_config_pb2.ModelServerConfig()
    model = config.model_config_list.config.add(name="echo", base_path=str(places["good"]),
                                                 model_platform="tensorflow")
    model.batching_parameters.max_batch_size.value = 8
    with grpc.insecure_channel(managed.target) as channel, pytest.raises(grpc.RpcError) as refused:
        model_service_pb2_grpc.ModelServiceStub(channel).HandleReloadConfigRequest(
            model_management_pb2.ReloadConfigRequest(config=config), timeout=60,
            metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert ("model 'echo': batching_parameters changed (max_batch_size unset -> 8) while version(s) 1 are "
            "loaded" in (refused.value.details() or ""))
    assert versions(managed.target, "echo") == "1:30"


def listening(port: int) -> set[str]:
    """The local addresses listening on a TCP port (IPv4 and IPv6), from /proc/net."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, port_hex = local.partition(":")
            if int(port_hex, 16) == port and state == "0A" and len(address) == width:
                found.add(address)
    return found


def test_the_bind_addresses_are_honoured(managed: ServerProcess) -> None:
    """127.0.0.1 only, as /proc/net writes it: plain, or IPv4-mapped on an IPv6 socket (grpc's)."""
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
    assert listening(managed.port) and listening(managed.port) <= loopback, listening(managed.port)
    assert listening(managed.rest_port) and listening(managed.rest_port) <= loopback
