"""TensorFlow Serving's command line (`tensorflow_model_server`), by its own flag names.

Every flag of TF Serving's main.cc is in one of three classes (FLAGS below, also the README's table):
- mapped: translated to this server's flags, with TF Serving's meaning where the two differ
  (`--rest_api_port=0` turns REST off; `--enable_batching=false` runs each request alone;
  `--model_base_path` without `--model_name` serves the model as "default");
- ignored: accepted, with one warning line naming it (it tunes something this server does its own
  way, or asks for what it already does);
- refused: an error naming the flag and why, when its value asks for what this server cannot do
  (the value TF Serving defaults to is accepted).

`--flag=value`, `--flag value` and, for switches, `--flag` / `--flag=true|false` work as in TF
Serving. Flags that are spelled the same in both (`--port`) are this server's own. The translation
runs before parsing, so the server's own rules (and its errors) apply to the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

MAPPED, IGNORED, REFUSED = "mapped", "ignored", "refused"
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


class FlagError(ValueError):
    """A TF Serving flag this server refuses, or a value it cannot read."""


@dataclass(frozen=True)
class Flag:
    name: str
    kind: str
    """MAPPED, IGNORED or REFUSED."""
    switch: bool
    """A bool flag: `--name` alone means true."""
    meaning: str
    """What it becomes here (mapped), or why it is ignored or refused."""
    translate: Callable[[str], list[str]] | None = None
    """Mapped: the value to this server's arguments."""
    refuses: Callable[[str], bool] | None = None
    """Refused: whether this value is refused (TF Serving's default is not)."""


def _to(flag: str) -> Callable[[str], list[str]]:
    return lambda value: [flag, value]


def _switch(value: str) -> bool:
    text = value.strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise FlagError(f"'{value}' is not true or false")


def _rest_port(value: str) -> list[str]:
    return ["--rest-api-port", "-1" if value.strip() == "0" else value]


def _batching(value: str) -> list[str]:
    return [] if _switch(value) else ["--no-batching"]


GRPC_ARGUMENTS = {
    "grpc.max_connection_age_ms": "--grpc-max-connection-age-ms",
    "grpc.max_connection_age_grace_ms": "--grpc-max-connection-age-grace-ms",
    "grpc.max_concurrent_streams": "--grpc-max-concurrent-streams",
    "grpc.server.max_pending_requests": "--grpc-max-pending-rpcs",
    "grpc.max_receive_message_length": "--max-message-bytes",
}


def _grpc_arguments(value: str) -> list[str]:
    """`grpc.NAME=VALUE,...`: the ones this server has a flag for."""
    out: list[str] = []
    for part in (p.strip() for p in value.split(",") if p.strip()):
        name, _, arg = part.partition("=")
        flag = GRPC_ARGUMENTS.get(name.strip())
        if flag is None:
            raise FlagError(f"gRPC argument '{name.strip()}' is not supported; supported: {', '.join(GRPC_ARGUMENTS)}")
        out += [flag, arg.strip()]
    return out


def _nonempty(value: str) -> bool:
    return bool(value.strip())


def _not_serve(value: str) -> bool:
    return {t.strip() for t in value.split(",") if t.strip()} not in (set(), {"serve"})


FLAGS = {f.name: f for f in (
    Flag("port", MAPPED, False, "--port (0 picks a free port here: the gRPC port is always open)", _to("--port")),
    Flag("rest_api_port", MAPPED, False, "--rest-api-port (0: no REST, as in TF Serving)", _rest_port),
    Flag("rest_api_timeout_in_ms", MAPPED, False, "--rest-api-timeout-ms: a REST request's deadline when it sends "
         "none", _to("--rest-api-timeout-ms")),
    Flag("model_name", MAPPED, False, "--model-name", _to("--model-name")),
    Flag("model_base_path", MAPPED, False, "--model-base-path (the model is named \"default\" unless --model_name "
         "says otherwise, as in TF Serving)", _to("--model-base-path")),
    Flag("model_config_file", MAPPED, False, "--model-config-file", _to("--model-config-file")),
    Flag("model_config_file_poll_wait_seconds", MAPPED, False, "--model-config-file-poll-wait-seconds",
         _to("--model-config-file-poll-wait-seconds")),
    Flag("file_system_poll_wait_seconds", MAPPED, False, "--file-system-poll-wait-seconds",
         _to("--file-system-poll-wait-seconds")),
    Flag("enable_batching", MAPPED, True, "false: --no-batching, each request runs alone and whole; true: this "
         "server's batching", _batching),
    Flag("batching_parameters_file", MAPPED, False, "--batching-parameters-file (ignored with "
         "--enable_batching=false, as in TF Serving)", _to("--batching-parameters-file")),
    Flag("monitoring_config_file", MAPPED, False, "--monitoring-config-file: whether metrics are served, and where",
         _to("--monitoring-config-file")),
    Flag("tensorflow_intra_op_parallelism", MAPPED, False, "--intra-op-threads", _to("--intra-op-threads")),
    Flag("tensorflow_inter_op_parallelism", MAPPED, False, "--inter-op-threads", _to("--inter-op-threads")),
    Flag("grpc_max_threads", MAPPED, False, "--max-concurrent-rpcs: requests handled at once",
         _to("--max-concurrent-rpcs")),
    Flag("grpc_channel_arguments", MAPPED, False, "grpc.max_connection_age_ms, grpc.max_connection_age_grace_ms, "
         "grpc.max_concurrent_streams, grpc.server.max_pending_requests and grpc.max_receive_message_length to "
         "their flags; others refused",
         _grpc_arguments),
    Flag("ssl_config_file", MAPPED, False, "--ssl-config-file: TLS on the gRPC port, the REST port plain, as in "
         "TF Serving", lambda value: ["--ssl-config-file", value] if value.strip() else []),
    Flag("enable_model_warmup", MAPPED, True, "--model-warmup / --no-model-warmup: replay each version's "
         "assets.extra/tf_serving_warmup_requests before it serves",
         lambda value: ["--model-warmup" if _switch(value) else "--no-model-warmup"]),
    Flag("num_request_iterations_for_warmup", MAPPED, False, "--warmup-iterations", _to("--warmup-iterations")),
    Flag("enable_serialization_as_tensor_content", MAPPED, True, "--tensor-content-outputs / "
         "--no-tensor-content-outputs: Predict answers in tensor_content rather than the typed fields",
         lambda value: ["--tensor-content-outputs" if _switch(value) else "--no-tensor-content-outputs"]),
    Flag("enable_signature_method_name_check", MAPPED, True, "--signature-method-name-check / "
         "--no-signature-method-name-check: Classify and Regress only on signatures of their method_name",
         lambda value: ["--signature-method-name-check" if _switch(value) else "--no-signature-method-name-check"]),
    Flag("version", MAPPED, True, "--version: print the version and exit",
         lambda value: ["--version"] if _switch(value) else []),
    Flag("rest_api_num_threads", IGNORED, False, "REST runs on the server's event loop, not a thread pool"),
    Flag("rest_api_enable_cors_support", IGNORED, True, "no CORS headers are sent"),
    Flag("allow_version_labels_for_unavailable_models", IGNORED, True,
         "a label may point at any version its policy serves"),
    Flag("enable_per_model_batching_parameters", IGNORED, True,
         "per-model batching comes from the model config file's batching_parameters block"),
    Flag("num_load_threads", IGNORED, False, "versions load one at a time in the model worker"),
    Flag("num_unload_threads", IGNORED, False, "versions unload one at a time in the model worker"),
    Flag("max_num_load_retries", IGNORED, False, "a failed load is retried with back-off while it is aspired"),
    Flag("load_retry_interval_micros", IGNORED, False, "retries back off from 1 s to 60 s"),
    Flag("flush_filesystem_caches", IGNORED, True, "nothing to flush"),
    Flag("tensorflow_session_parallelism", IGNORED, False, "use --tensorflow_intra_op_parallelism"),
    Flag("per_process_gpu_memory_fraction", IGNORED, False, "GPU memory is TensorFlow's default"),
    Flag("remove_unused_fields_from_bundle_metagraph", IGNORED, True, "signatures are read once at load"),
    Flag("prefer_tflite_model", IGNORED, True, "SavedModels only"),
    Flag("num_tflite_pools", IGNORED, False, "SavedModels only"),
    Flag("num_tflite_interpreters_per_pool", IGNORED, False, "SavedModels only"),
    Flag("xla_cpu_compilation_enabled", IGNORED, True, "TensorFlow's default"),
    Flag("enable_profiler", IGNORED, True, "no profiler service"),
    Flag("skip_initialize_tpu", IGNORED, True, "no TPU support"),
    Flag("enable_grpc_healthcheck_service", IGNORED, True, "grpc.health.v1.Health is always served"),
    Flag("grpc_socket_path", REFUSED, False, "gRPC over a UNIX socket is not served", refuses=_nonempty),
    Flag("use_alts_credentials", REFUSED, True, "ALTS is not supported; use TLS (--tls-cert-file)", refuses=_switch),
    Flag("platform_config_file", REFUSED, False, "only TensorFlow SavedModels are served, configured by flags",
         refuses=_nonempty),
    Flag("tensorflow_session_config_file", REFUSED, False, "TensorFlow's threads are set with "
         "--tensorflow_intra_op_parallelism and --tensorflow_inter_op_parallelism", refuses=_nonempty),
    Flag("saved_model_tags", REFUSED, False, "the 'serve' MetaGraph is loaded", refuses=_not_serve),
    Flag("thread_pool_factory_config_file", REFUSED, False, "no custom thread pools", refuses=_nonempty),
    Flag("mixed_precision", REFUSED, False, "models run as exported", refuses=_nonempty),
    Flag("xla_gpu_compilation_enabled", REFUSED, True, "XLA:GPU JIT is not switched on here", refuses=_switch),
)}


def translate(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(this server's arguments, one warning per ignored flag). FlagError names a refused flag or
    a value that cannot be read. Arguments that are not TF Serving's pass through unchanged."""
    out: list[str] = []
    warnings: list[str] = []
    named_model = base_path_given = False
    batching_off = False
    batching_file: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        name, has_value, value = arg[2:].partition("=") if arg.startswith("--") else ("", False, "")
        flag = FLAGS.get(name)
        if flag is None:
            out.append(arg)
            if arg.startswith(("--model-name", "--model_name")):
                named_model = True
            continue
        if not has_value:
            if flag.switch:
                value = "true"
            elif i < len(args):
                value, i = args[i], i + 1
            else:
                raise FlagError(f"--{name} needs a value")
        try:
            if flag.kind == IGNORED:
                warnings.append(f"--{name} is accepted and ignored: {flag.meaning}")
            elif flag.kind == REFUSED:
                if flag.refuses is not None and flag.refuses(value):
                    raise FlagError(flag.meaning)
            else:
                assert flag.translate is not None
                translated = flag.translate(value)
                if name == "batching_parameters_file":
                    batching_file = translated
                    continue
                if name == "enable_batching":
                    batching_off = bool(translated)
                named_model = named_model or name == "model_name"
                base_path_given = base_path_given or name == "model_base_path"
                out += translated
        except FlagError as exc:
            raise FlagError(f"--{name}={value}: {exc}") from None
    if batching_off and batching_file:
        warnings.append("--batching_parameters_file is ignored: --enable_batching=false, as in TF Serving")
    elif batching_file:
        out += batching_file
    if base_path_given and not named_model:
        out += ["--model-name", "default"]
    return out, warnings


def table() -> list[tuple[str, str, str]]:
    """(flag, class, meaning) of every TF Serving flag, for the README."""
    return [(f"--{f.name}", f.kind, f.meaning) for f in FLAGS.values()]
