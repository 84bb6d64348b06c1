"""server.api.control: who may change the served models, and from where. No server needed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from server.api.control import ClientCertificate, ControlPlane, default_roots, grpc_credentials, read_admins
from server.core.model_config import ModelSource
from server.errors import InvalidInput, PermissionDenied, Unauthenticated

METHOD = "HandleReloadConfigRequest"


def tokens_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tokens"
    path.write_text(text)
    return str(path)


def test_token_file_lines(tmp_path: Path) -> None:
    admins = read_admins(tokens_file(tmp_path, "# admins\n\nalice s3cr3t-a\n  t0ken-b  \n"
                                               "client-certificate ops-bot\nclient-certificate spiffe://x/y\n"))
    assert admins.tokens == {"s3cr3t-a": "alice", "t0ken-b": "token of line 4"}
    assert admins.certificates == {"ops-bot", "spiffe://x/y"}
    assert read_admins(tokens_file(tmp_path, "client-certificate a\n")).tokens == {}
    with pytest.raises(ValueError, match="holds no token and no client-certificate line"):
        read_admins(tokens_file(tmp_path, "# nothing\n"))
    with pytest.raises(ValueError, match=":2: the same token is on line"):
        read_admins(tokens_file(tmp_path, "a x\nb x\n"))
    with pytest.raises(ValueError, match=":1: expected 'TOKEN', 'NAME TOKEN' or 'client-certificate NAME'"):
        read_admins(tokens_file(tmp_path, "a b c\n"))


def test_management_off_is_permission_denied_naming_the_flag(caplog: pytest.LogCaptureFixture) -> None:
    plane = ControlPlane(False, {"t": "alice"}, False, ["/m"])
    with caplog.at_level(logging.INFO, logger="server.control"), pytest.raises(PermissionDenied) as denied:
        plane.authorize(METHOD, "ipv4:10.0.0.9:4242", "Bearer t", None)
    assert "--enable-model-management" in str(denied.value)
    assert "from ipv4:10.0.0.9:4242 by -: denied: model management is off" in caplog.text


def test_tokens_are_checked_and_only_the_name_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    plane = ControlPlane(True, {"s3cr3t": "alice"}, False, ["/m"])
    with caplog.at_level(logging.INFO, logger="server.control"):
        assert plane.authorize(METHOD, "p", "Bearer s3cr3t", None).identity == "alice"
        assert plane.authorize(METHOD, "p", "bearer   s3cr3t ", None).identity == "alice"
        for wrong in ("Bearer s3cr3", "Bearer s3cr3t2", "Basic s3cr3t", "s3cr3t", "Bearer "):
            with pytest.raises(Unauthenticated, match="not 'Bearer TOKEN'"):
                plane.authorize(METHOD, "p", wrong, None)
        with pytest.raises(Unauthenticated, match="needs 'authorization: Bearer TOKEN'"):
            plane.authorize(METHOD, "p", None, ClientCertificate(("client",)))  # only under mutual TLS
    assert "s3cr3t" not in caplog.text
    assert caplog.text.count("denied: invalid token") == 5


def test_under_mutual_tls_only_an_admins_certificate_is_a_credential(caplog: pytest.LogCaptureFixture) -> None:
    plane = ControlPlane(True, {}, True, ["/m"], frozenset({"ops-bot", "spiffe://corp/admin"}))
    assert plane.authorize(METHOD, "p", None, ClientCertificate(("ops-bot",))).identity == "certificate ops-bot"
    by_san = plane.authorize(METHOD, "p", None, ClientCertificate(("svc", "spiffe://corp/admin")))
    assert by_san.identity == "certificate svc, spiffe://corp/admin"
    with caplog.at_level(logging.INFO, logger="server.control"), pytest.raises(PermissionDenied) as denied:
        plane.authorize(METHOD, "ipv4:10.1.1.1:5", None, ClientCertificate(("inference-client", "ops-bot.evil")))
    assert "(inference-client, ops-bot.evil) is not an admin's" in str(denied.value)
    assert "by certificate inference-client, ops-bot.evil: denied: not an admin certificate" in caplog.text
    with pytest.raises(Unauthenticated, match="or a client certificate"):
        plane.authorize(METHOD, "p", None, None)


def test_base_paths_must_resolve_inside_a_root_whether_they_exist_or_not(tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / "good" / "1").mkdir(parents=True)
    outside = tmp_path / "evil"
    (outside / "1").mkdir(parents=True)
    (root / "link").symlink_to(outside)
    (tmp_path / "models-not").mkdir()  # shares the root's name as a prefix
    plane = ControlPlane(True, {"t": "alice"}, False, [str(root)])
    plane.check_paths([ModelSource("good", str(root / "good")), ModelSource("not-yet", str(root / "missing"))])
    messages = []
    for path in (outside, root / "link", root / ".." / "evil", tmp_path / "models-not", tmp_path / "nowhere",
                 Path("/etc")):
        with pytest.raises(InvalidInput) as refused:
            plane.check_paths([ModelSource("m", str(path))])
        messages.append(str(refused.value).replace(str(path), "PATH"))
    assert len(set(messages)) == 1, messages  # the same answer, existing or not
    assert "is not inside a model root (--model-root: " in messages[0]


def test_default_roots_are_the_folders_holding_the_start_up_models(tmp_path: Path) -> None:
    sources = [ModelSource("a", str(tmp_path / "models" / "a")), ModelSource("b", str(tmp_path / "models" / "b")),
               ModelSource("c", str(tmp_path / "other" / "c"))]
    assert default_roots(sources) == (str(tmp_path / "models"), str(tmp_path / "other"))


def test_grpc_credentials_read_from_metadata_and_the_auth_context() -> None:
    assert grpc_credentials((("user-agent", "x"), ("authorization", "Bearer t")), {}) == ("Bearer t", None)
    assert grpc_credentials(None, {"x509_common_name": [b"client"]}) == (None, ClientCertificate(("client",)))
