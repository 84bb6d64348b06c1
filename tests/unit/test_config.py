"""server.config: flags, MIRRORSERVE_* environment fallbacks, defaults, and refusals."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from server.config import Settings, batch_sizes_problem, parse_settings


def parse(*argv: str, **env: str) -> Settings:
    return parse_settings(list(argv), environ=env)


def test_defaults_without_base_path() -> None:
    s = parse()
    assert s.model_base_path is None
    assert s.model_name == "demo"
    assert s.port == 8500
    assert s.replicas is None
    assert s.max_batch_size == 64
    assert s.batch_timeout_ms is None, "auto"
    assert s.batch_timeout_s is None
    assert (s.max_inflight_batches, s.allowed_batch_sizes, s.batching_parameters_file) == (1, (), None)
    assert s.max_queued_rows == 4096
    assert (s.rest_api_port, s.metrics_port) == (8501, -1), "metrics live on the REST port unless asked apart"
    assert s.max_message_bytes == 64 * 1024 * 1024


@pytest.mark.parametrize(
    ("base", "name"),
    [("/x/mymodel/", "mymodel"), ("/x/mymodel", "mymodel"), ("models/resnet//", "resnet"), ("plain", "plain")],
)
def test_model_name_defaults_to_base_folder_name(base: str, name: str) -> None:
    s = parse("--model-base-path", base)
    assert s.model_base_path == base
    assert s.model_name == name


def test_explicit_model_name_wins() -> None:
    assert parse("--model-base-path", "/x/mymodel/", "--model-name", "prod").model_name == "prod"
    assert parse("--model-name", "prod").model_name == "prod"


def test_config_file_flags() -> None:
    s = parse("--model-config-file", "/etc/models.config", "--file-system-poll-wait-seconds", "0",
              "--model-config-file-poll-wait-seconds", "30")
    assert (s.model_config_file, s.model_base_path, s.model_name) == ("/etc/models.config", None, "")
    assert (s.file_system_poll_wait_seconds, s.model_config_file_poll_wait_seconds) == (0.0, 30.0)


@pytest.mark.parametrize("other", [["--model-base-path", "/m/a"], ["--model-name", "a"]])
def test_config_file_excludes_the_one_model_flags(other: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--model-config-file", "/etc/models.config", *other)
    assert "--model-config-file replaces --model-base-path and --model-name" in capsys.readouterr().err


def test_all_flags() -> None:
    s = parse(
        "--model-base-path", "/m/a", "--model-name", "n", "--port", "0", "--replicas", "4", "--frontends", "3",
        "--max-batch-size", "8", "--batch-timeout-ms", "0.5", "--allowed-batch-sizes", "2,4,8",
        "--max-queued-rows", "100",
        "--metrics-port", "9090", "--rest-api-port", "0", "--max-message-bytes", "1024", "--drain-delay-s", "0.5",
        "--request-bytes-budget", "4096", "--grace-period-s", "9", "--log-format", "json", "--log-level", "DEBUG",
        "--grpc-max-connection-age-ms", "60000", "--grpc-max-connection-age-grace-ms", "5000",
        "--max-inflight-batches", "1", "--event-loop", "asyncio", "--batching_parameters_file", "/etc/batching",
        "--grpc-bind-address", "127.0.0.1", "--rest-bind-address", "::1", "--grpc-max-concurrent-streams", "64",
        "--grpc-max-pending-rpcs", "300",
        "--enable-model-management", "--admin-token-file", "/etc/tokens", "--model-root", "/m", "--model-root", "/n",
    )
    assert s == Settings(
        model_base_path="/m/a", model_name="n", model_config_file=None, model_repository=None,
        model_control_mode="none", load_models=(), file_system_poll_wait_seconds=1.0,
        model_config_file_poll_wait_seconds=0.0, port=0, rest_api_port=0, replicas=4, max_batch_size=8,
        batch_timeout_ms=0.5, allowed_batch_sizes=(2, 4, 8), batching_parameters_file="/etc/batching",
        max_queued_rows=100, metrics_port=9090, max_message_bytes=1024, request_bytes_budget=4096,
        drain_delay_s=0.5, grace_period_s=9.0, log_format="json", log_level="DEBUG",
        max_concurrent_rpcs=1024, tls_cert_file=None, tls_key_file=None, tls_client_ca_file=None,
        grpc_max_connection_age_ms=60_000, grpc_max_connection_age_grace_ms=5_000,
        max_inflight_batches=1, intra_op_threads=0, inter_op_threads=0, event_loop="asyncio",
        grpc_bind_address="127.0.0.1", rest_bind_address="::1", grpc_max_concurrent_streams=64,
        grpc_max_pending_rpcs=300, frontends=3,
        enable_model_management=True, admin_token_file="/etc/tokens", model_roots=("/m", "/n"),
        rest_api_timeout_ms=0.0, monitoring_config_file=None,
    )
    assert s.batch_timeout_s == pytest.approx(0.0005)
    assert parse("--batch-timeout-ms", "0").batch_timeout_ms == 0.0
    assert parse("--batch-timeout-ms", "auto").batch_timeout_ms is None
    assert parse("--batch-timeout-ms", "AUTO", "--batch-timeout-ms", "3").batch_timeout_s == pytest.approx(0.003)


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse().port = 1  # type: ignore[misc]


def test_environment_used_when_flag_absent() -> None:
    s = parse(
        MIRRORSERVE_MAX_BATCH_SIZE="16",
        MIRRORSERVE_PORT="9000",
        MIRRORSERVE_BATCH_TIMEOUT_MS="7.5",
        MIRRORSERVE_MAX_QUEUED_ROWS="50",
        MIRRORSERVE_REPLICAS="2",
        MIRRORSERVE_METRICS_PORT="-1",
        MIRRORSERVE_MAX_MESSAGE_BYTES="2048",
        MIRRORSERVE_MODEL_BASE_PATH="/srv/models/ranker/",
    )
    assert s.max_batch_size == 16
    assert s.port == 9000
    assert s.batch_timeout_ms == 7.5
    assert s.max_queued_rows == 50
    assert s.replicas == 2
    assert s.metrics_port == -1
    assert s.max_message_bytes == 2048
    assert s.model_base_path == "/srv/models/ranker/"
    assert s.model_name == "ranker"
    assert isinstance(s.max_batch_size, int)
    assert isinstance(s.port, int)


def test_environment_model_name() -> None:
    assert parse(MIRRORSERVE_MODEL_NAME="envname").model_name == "envname"
    assert parse("--model-name", "flag", MIRRORSERVE_MODEL_NAME="envname").model_name == "flag"


def test_flag_wins_over_environment() -> None:
    s = parse("--max-batch-size", "32", "--port", "7000", MIRRORSERVE_MAX_BATCH_SIZE="16", MIRRORSERVE_PORT="9000")
    assert s.max_batch_size == 32
    assert s.port == 7000


def test_unrelated_environment_ignored() -> None:
    s = parse(MAX_BATCH_SIZE="3", MIRRORSERVE_UNKNOWN="x", mirrorserve_port="1")
    assert s.max_batch_size == 64
    assert s.port == 8500


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIRRORSERVE_MAX_QUEUED_ROWS", "77")
    assert parse_settings([]).max_queued_rows == 77


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-batch-size", "0"],
        ["--max-batch-size", "-3"],
        ["--max-batch-size", "abc"],
        ["--max-batch-size", "1.5"],
        ["--max-queued-rows", "0"],
        ["--replicas", "0"],
        ["--max-message-bytes", "0"],
        ["--port", "65536"],
        ["--port", "-2"],
        ["--port", "http"],
        ["--metrics-port", "70000"],
        ["--rest-api-port", "-2"],
        ["--rest-api-port", "8500"],
        ["--port", "9000", "--metrics-port", "9000"],
        ["--batch-timeout-ms", "-1"],
        ["--batch-timeout-ms", "nan"],
        ["--batch-timeout-ms", "soon"],
        ["--max-auto-wait-ms", "2"],
        ["--allowed-batch-sizes", "4,2,64"],
        ["--allowed-batch-sizes", "0,64"],
        ["--allowed-batch-sizes", "2,x"],
        ["--allowed-batch-sizes", "2,4,8"],
        ["--allowed-batch-sizes", "2,4,8", "--max-batch-size", "16"],
        ["--no-such-flag"],
    ],
    ids=" ".join,
)
def test_invalid_flags_exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_the_allowed_batch_sizes_rule_names_what_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    assert batch_sizes_problem((), 8) is None
    assert batch_sizes_problem((2, 4, 8), 8) is None
    assert batch_sizes_problem((4, 2), None) == "allowed_batch_sizes must be positive and increasing, got [4, 2]"
    assert batch_sizes_problem((0, 8), 8) == "allowed_batch_sizes must be positive and increasing, got [0, 8]"
    assert batch_sizes_problem((2, 4), 8, max_name="the batch budget") == (
        "the last of allowed_batch_sizes (4) must equal the batch budget (8)")
    with pytest.raises(SystemExit):
        parse("--allowed-batch-sizes", "2,4,8", "--max-batch-size", "16")
    assert "the last of --allowed-batch-sizes (8) must equal --max-batch-size (16)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("MIRRORSERVE_PORT", "abc"),
        ("MIRRORSERVE_PORT", "99999"),
        ("MIRRORSERVE_MAX_BATCH_SIZE", "0"),
        ("MIRRORSERVE_MAX_BATCH_SIZE", "many"),
        ("MIRRORSERVE_BATCH_TIMEOUT_MS", "-0.1"),
        ("MIRRORSERVE_REPLICAS", "0"),
    ],
)
def test_invalid_environment_exits_naming_the_variable(
    var: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse(**{var: value})
    assert info.value.code == 2
    assert f"{var}={value!r}" in capsys.readouterr().err


def test_grpc_port_minus_one_refused() -> None:
    with pytest.raises(SystemExit):
        parse("--port", "-1")


def test_drain_settings() -> None:
    s = parse()
    assert (s.drain_delay_s, s.grace_period_s, s.log_format, s.log_level) == (2.0, 25.0, "text", "INFO")
    assert parse(MIRRORSERVE_DRAIN_DELAY_S="0", MIRRORSERVE_GRACE_PERIOD_S="3").grace_period_s == 3.0
    with pytest.raises(SystemExit):
        parse("--drain-delay-s", "5", "--grace-period-s", "5")  # the delay must leave time to finish
    with pytest.raises(SystemExit):
        parse("--log-format", "xml")


def test_tls_settings() -> None:
    assert parse().tls_mode == "off"
    server = parse("--tls-cert-file", "c.pem", "--tls-key-file", "k.pem")
    assert (server.tls_cert_file, server.tls_key_file, server.tls_mode) == ("c.pem", "k.pem", "server")
    assert parse("--tls-cert-file", "c", "--tls-key-file", "k", "--tls-client-ca-file", "ca").tls_mode == "mutual"
    assert parse(MIRRORSERVE_TLS_CERT_FILE="c", MIRRORSERVE_TLS_KEY_FILE="k").tls_mode == "server"
    for incomplete in (["--tls-cert-file", "c"], ["--tls-key-file", "k"], ["--tls-client-ca-file", "ca"]):
        with pytest.raises(SystemExit):
            parse(*incomplete)


def test_performance_settings() -> None:
    s = parse("--max-inflight-batches", "2", "--intra-op-threads", "2", "--inter-op-threads", "1")
    assert (s.max_inflight_batches, s.intra_op_threads, s.inter_op_threads) == (2, 2, 1)
    assert parse(MIRRORSERVE_MAX_INFLIGHT_BATCHES="3").max_inflight_batches == 3
    for bad in (["--max-inflight-batches", "0"], ["--intra-op-threads", "-1"]):
        with pytest.raises(SystemExit):
            parse(*bad)


def test_defaults_run_two_batches_at_once_on_uvloop() -> None:
    s = parse()
    assert (s.max_inflight_batches, s.event_loop) == (1, "uvloop")


def test_unknown_event_loop_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--event-loop", "trio")
    assert "--event-loop" in capsys.readouterr().err


def test_model_management_is_off_by_default_and_on_needs_a_credential(capsys: pytest.CaptureFixture[str]) -> None:
    s = parse()
    assert (s.enable_model_management, s.admin_token_file, s.model_roots) == (False, None, ())
    assert (s.grpc_bind_address, s.rest_bind_address, s.grpc_max_concurrent_streams) == ("", "", 256)
    assert s.grpc_max_pending_rpcs == 0
    with pytest.raises(SystemExit):
        parse("--enable-model-management")
    assert "needs a credential: --admin-token-file (tokens, or admins' client certificates by name), or " \
           "--admin-client-ca-file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--admin-token-file", "/t")
    assert "give --enable-model-management too" in capsys.readouterr().err
    tls = ("--tls-cert-file", "c", "--tls-key-file", "k", "--tls-client-ca-file", "ca")
    with pytest.raises(SystemExit):  # mutual TLS alone is no admin credential: inference clients have it too
        parse("--enable-model-management", *tls)
    with pytest.raises(SystemExit):
        parse("--enable-model-management", "--admin-client-ca-file", "admins")
    assert "give --enable-model-management and --tls-client-ca-file too" in capsys.readouterr().err
    mutual = parse("--enable-model-management", *tls, "--admin-client-ca-file", "admins")
    assert mutual.enable_model_management and (mutual.admin_token_file, mutual.admin_client_ca_file) == (
        None, "admins")


def test_switches_and_repeatable_flags_from_the_environment(capsys: pytest.CaptureFixture[str]) -> None:
    s = parse(MIRRORSERVE_ENABLE_MODEL_MANAGEMENT="true", MIRRORSERVE_ADMIN_TOKEN_FILE="/t",
              MIRRORSERVE_MODEL_ROOT="/a:/b")
    assert (s.enable_model_management, s.model_roots) == (True, ("/a", "/b"))
    assert parse(MIRRORSERVE_ENABLE_MODEL_MANAGEMENT="0").enable_model_management is False
    # The command line wins over the environment, whole: its roots replace the environment's.
    assert parse("--model-root", "/c", MIRRORSERVE_MODEL_ROOT="/a:/b").model_roots == ("/c",)
    with pytest.raises(SystemExit):
        parse(MIRRORSERVE_ENABLE_MODEL_MANAGEMENT="maybe")
    assert "MIRRORSERVE_ENABLE_MODEL_MANAGEMENT='maybe': must be one of 1, true" in capsys.readouterr().err


def test_grpc_pending_queue_is_sized_from_the_concurrency_limit() -> None:
    from server.frontends.grpc_options import grpc_options

    options = dict(grpc_options(parse("--max-concurrent-rpcs", "256")))
    assert (options["grpc.server.max_pending_requests"],
            options["grpc.server.max_pending_requests_hard_limit"]) == (1024, 2048)
    options = dict(grpc_options(parse("--grpc-max-pending-rpcs", "5000")))
    assert (options["grpc.server.max_pending_requests"],
            options["grpc.server.max_pending_requests_hard_limit"]) == (5000, 10000)


def test_connection_age_in_seconds_is_the_same_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse("--grpc-max-connection-age-seconds", "1.5").grpc_max_connection_age_ms == 1500
    with pytest.raises(SystemExit):
        parse("--grpc-max-connection-age-seconds", "60", "--grpc-max-connection-age-ms", "5000")
    assert "are one setting" in capsys.readouterr().err


def test_frontends_is_a_count_or_auto(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse("--frontends", "4").frontends == 4
    assert parse().frontends >= 1
    with pytest.raises(SystemExit):
        parse("--frontends", "0")
    assert "--frontends" in capsys.readouterr().err


def test_auto_frontends_is_one_up_to_two_cores_then_one_per_two(tmp_path: Path) -> None:
    from server.config import auto_frontends, usable_cores

    assert [auto_frontends(c) for c in (0.5, 1, 1.5, 2, 3, 4, 7, 16, 64)] == [1, 1, 1, 1, 1, 2, 3, 8, 8]
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # a container limited to 1.5 cores
    assert usable_cores(tmp_path) == min(1.5, len(os.sched_getaffinity(0)))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(tmp_path) == len(os.sched_getaffinity(0))


def test_the_request_bytes_budget_follows_the_containers_memory_limit(tmp_path: Path) -> None:
    from server.config import auto_bytes_budget, memory_limit

    assert memory_limit(tmp_path) is None and auto_bytes_budget(None) == 1 << 30
    (tmp_path / "memory.max").write_text("max\n")
    assert memory_limit(tmp_path) is None
    (tmp_path / "memory.max").write_text(f"{4 << 30}\n")
    assert memory_limit(tmp_path) == 4 << 30 and auto_bytes_budget(4 << 30) == 512 << 20
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1: unlimited
    assert memory_limit(tmp_path) is None
