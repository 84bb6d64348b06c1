"""TF Serving's command line (server.tfs_flags): each mapped flag sets what it says, ignored ones
warn by name, refused ones stop the start naming why, in every spelling TF Serving accepts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from server import tfs_flags
from server.config import Settings, parse_settings

DOCS = (Path(__file__).resolve().parents[2] / "docs" / "tf-serving-flags.md").read_text()


def parse(*argv: str) -> Settings:
    return parse_settings(list(argv), environ={})


def test_the_docs_table_is_the_codes() -> None:
    rows = [f"| `{name}` | {kind} | {meaning} |" for name, kind, meaning in tfs_flags.table()]
    assert len(rows) == 48  # every flag of tensorflow_model_server's main.cc
    assert all(row in DOCS for row in rows)


def test_a_command_line_from_tf_servings_documentation() -> None:
    s = parse("--port=8500", "--rest_api_port=8501", "--model_config_file=/models/models.config",
              "--model_config_file_poll_wait_seconds=60", "--enable_batching=true",
              "--batching_parameters_file=/models/batching.config",
              "--monitoring_config_file=/models/monitoring.config",
              "--tensorflow_intra_op_parallelism=4")
    assert (s.port, s.rest_api_port, s.model_config_file, s.model_config_file_poll_wait_seconds) == (
        8500, 8501, "/models/models.config", 60.0)
    assert (s.batching_parameters_file, s.monitoring_config_file, s.intra_op_threads) == (
        "/models/batching.config", "/models/monitoring.config", 4)
    assert s.max_batch_size == 64 and s.flag_warnings == ()


@pytest.mark.parametrize(("argv", "field", "value"), [
    (["--rest_api_port=0"], "rest_api_port", -1),  # TF Serving's 0: no REST
    (["--rest_api_port", "9001"], "rest_api_port", 9001),
    (["--rest_api_timeout_in_ms=2500"], "rest_api_timeout_ms", 2500.0),
    (["--model_base_path=/m/ranker"], "model_name", "default"),  # TF Serving's default name
    (["--model_base_path=/m/ranker", "--model_name=ranker"], "model_name", "ranker"),
    (["--model_name", "ranker", "--model_base_path", "/m/x"], "model_name", "ranker"),
    (["--model_base_path=/m/ranker"], "model_base_path", "/m/ranker"),
    (["--file_system_poll_wait_seconds=5"], "file_system_poll_wait_seconds", 5.0),
    (["--model_config_file=/c", "--model_config_file_poll_wait_seconds=30"], "model_config_file_poll_wait_seconds",
     30.0),
    (["--enable_batching=false"], "batching", False),
    (["--enable_batching=false"], "max_batch_size", 64),  # batching off runs each request whole
    (["--enable_batching=true"], "batching", True),
    (["--enable_batching=false", "--batching_parameters_file=/b"], "batching_parameters_file", None),
    (["--enable_batching", "--batching_parameters_file=/b"], "batching_parameters_file", "/b"),
    (["--enable_batching=true"], "max_batch_size", 64),
    (["--monitoring_config_file=/mon"], "monitoring_config_file", "/mon"),
    (["--tensorflow_intra_op_parallelism", "3"], "intra_op_threads", 3),
    (["--tensorflow_inter_op_parallelism=2"], "inter_op_threads", 2),
    (["--grpc_max_threads=48"], "max_concurrent_rpcs", 48),
    (["--grpc_channel_arguments=grpc.max_connection_age_ms=2000,grpc.max_connection_age_grace_ms=500"],
     "grpc_max_connection_age_ms", 2000),
    (["--grpc_channel_arguments=grpc.max_receive_message_length=1048576"], "max_message_bytes", 1 << 20),
    (["--grpc_channel_arguments=grpc.server.max_pending_requests=5000"], "grpc_max_pending_rpcs", 5000),
    (["--enable_model_warmup=false"], "model_warmup", False),
    (["--num_request_iterations_for_warmup=3"], "warmup_iterations", 3),
    (["--enable_signature_method_name_check"], "signature_method_name_check", True),
    (["--enable_signature_method_name_check=false"], "signature_method_name_check", False),
    (["--ssl_config_file=/etc/ssl.config"], "ssl_config_file", "/etc/ssl.config"),
    (["--port=0"], "port", 0),
])
def test_each_mapped_flag_sets_what_it_says(argv: list[str], field: str, value: object) -> None:
    assert getattr(parse(*argv), field) == value


def test_version_prints_and_exits(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse("--version")
    assert stopped.value.code == 0 and capsys.readouterr().out.startswith("mirrorserve ")
    assert parse("--version=false").port == 8500


def test_ignored_flags_warn_by_name() -> None:
    s = parse("--enable_profiler", "--rest_api_num_threads=8", "--flush_filesystem_caches=false",
              "--enable_batching=false", "--batching_parameters_file=/b")
    assert [w.split()[0] for w in s.flag_warnings] == [
        "--enable_profiler", "--rest_api_num_threads", "--flush_filesystem_caches", "--batching_parameters_file"]
    assert "ignored" in s.flag_warnings[0]


@pytest.mark.parametrize(("argv", "why"), [
    (["--ssl_config_file=/ssl.config", "--tls-cert-file=/c", "--tls-key-file=/k"], "both set TLS; give one"),
    (["--grpc_socket_path=/tmp/s"], "UNIX socket"),
    (["--use_alts_credentials"], "ALTS"),
    (["--platform_config_file=/p"], "SavedModels"),
    (["--saved_model_tags=serve,gpu"], "'serve'"),
    (["--grpc_channel_arguments=grpc.keepalive_time_ms=10"], "grpc.keepalive_time_ms"),
    (["--enable_batching=maybe"], "not true or false"),
    (["--model_name"], "needs a value"),
])
def test_refused_flags_stop_the_start_naming_why(argv: list[str], why: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse(*argv)
    error = capsys.readouterr().err
    assert stopped.value.code == 2 and argv[0].split("=")[0] in error and why in error, error


def test_their_defaults_are_accepted_silently() -> None:
    s = parse("--use_alts_credentials=false", "--saved_model_tags=serve", "--ssl_config_file=", "--grpc_socket_path=")
    assert s.flag_warnings == () and s.ssl_config_file is None



def test_the_mirrorserve_command_takes_the_same_arguments() -> None:
    command = Path(sys.executable).parent / "mirrorserve"  # pyproject's [project.scripts]
    done = subprocess.run([str(command), "--version"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.startswith("mirrorserve "), done.stderr
    done = subprocess.run([str(command), "--use_alts_credentials"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2 and "--use_alts_credentials" in done.stderr


def test_the_readme_lists_every_flag_in_its_class() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in readme.splitlines()
            if line.startswith(("| mapped |", "| ignored |", "| refused |"))}
    for name, kind, _ in tfs_flags.table():
        assert f"`{name[2:]}`" in rows[kind], (name, kind)


def test_tensor_content_serialization_maps_to_tensor_content_outputs() -> None:
    assert parse().tensor_content_outputs is False  # typed fields, as TF Serving answers by default
    assert parse("--enable_serialization_as_tensor_content=true").tensor_content_outputs is True
    assert parse("--enable_serialization_as_tensor_content=false").tensor_content_outputs is False
