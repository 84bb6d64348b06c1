"""--model-repository and --model-control-mode: the flags' rules, which models a repository
starts with, and which names may address a folder of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.config import parse_settings
from server.core.model_config import ConfigError
from server.core.repository import check_model_name, repository_sources
from server.errors import InvalidInput


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for name in ("b", "a", ".hidden"):
        (tmp_path / name / "1").mkdir(parents=True)
    (tmp_path / "file.txt").write_text("not a model")
    return tmp_path


def test_mode_none_starts_with_every_model_folder(root: Path) -> None:
    sources = repository_sources(str(root), "none", ())
    assert [(s.name, s.base_path) for s in sources] == [("a", str(root / "a")), ("b", str(root / "b"))]


def test_explicit_mode_starts_with_what_load_model_names(root: Path) -> None:
    assert [s.name for s in repository_sources(str(root), "explicit", ())] == []
    assert [s.name for s in repository_sources(str(root), "explicit", ("b", "b"))] == ["b"]
    assert [s.name for s in repository_sources(str(root), "explicit", ("*",))] == ["a", "b"]
    with pytest.raises(ConfigError, match=r"--load-model c: no such model folder .*there: a, b"):
        repository_sources(str(root), "explicit", ("c",))
    with pytest.raises(ConfigError, match="is not a folder"):
        repository_sources(str(root / "file.txt"), "none", ())


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../a", "a\\b", "a\0", "x" * 256])
def test_a_name_must_be_one_folder_name(name: str) -> None:
    with pytest.raises(InvalidInput, match="not a folder name"):
        check_model_name(name)


def test_the_flags_rules() -> None:
    settings = parse_settings(["--model-repository", "/m", "--model-control-mode", "explicit", "--load-model", "a",
                               "--load-model", "b"], environ={})
    assert (settings.model_repository, settings.model_control_mode, settings.load_models) == (
        "/m", "explicit", ("a", "b"))
    assert settings.model_name == ""
    assert parse_settings(["--model-repository", "/m"], environ={}).model_control_mode == "none"
    env = parse_settings([], environ={"MIRRORSERVE_MODEL_REPOSITORY": "/m", "MIRRORSERVE_MODEL_CONTROL_MODE":
                                      "explicit", "MIRRORSERVE_LOAD_MODEL": "a:b"})
    assert env.load_models == ("a", "b")
    for wrong in (["--model-repository", "/m", "--model-base-path", "/x"],
                  ["--model-repository", "/m", "--model-config-file", "/c"],
                  ["--model-control-mode", "explicit"],
                  ["--model-repository", "/m", "--load-model", "a"],
                  ["--model-repository", "/m", "--model-control-mode", "poll"]):
        with pytest.raises(SystemExit):
            parse_settings(wrong, environ={})
