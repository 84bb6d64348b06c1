"""One frozen settings object, parsed from flags with environment-variable fallbacks.

Every flag `--some-flag` can also be given as `MIRRORSERVE_SOME_FLAG`; a flag on the command
line wins over the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import itertools
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from server import event_loop, tfs_flags
from server.core.version_folders import local_path

ENV_PREFIX = "MIRRORSERVE_"


@dataclass(frozen=True)
class Settings:
    model_base_path: str | None
    """TF Serving layout BASE/<version>/saved_model.pb; None (and no config file) serves the
    built-in demo model."""
    model_name: str
    """Name clients put in model_spec.name (the one-model shorthand)."""
    model_config_file: str | None
    """TF Serving's ModelServerConfig text file: several models, version policies and labels."""
    model_repository: str | None
    """Triton's way: a folder whose every subfolder is a model (in TF Serving's version layout)."""
    model_control_mode: str
    """none: every model of --model-repository at start, no load/unload calls; explicit: only
    --load-model's and what load calls ask for."""
    load_models: tuple[str, ...]
    """Models of --model-repository served from the start in explicit mode."""
    file_system_poll_wait_seconds: float
    """How often version folders are re-read for new and removed versions; 0 reads them once."""
    model_config_file_poll_wait_seconds: float
    """How often the config file is re-read (applied when it changed); 0 reads it once."""
    port: int
    """gRPC port; 0 picks a free one (logged at start)."""
    rest_api_port: int
    """HTTP port of both REST APIs and of /metrics; 0 picks a free one, -1 turns HTTP off."""
    frontends: int
    """Front-end processes answering gRPC and REST on the same ports (SO_REUSEPORT); the first also
    owns the model lifecycle, and all feed the one model worker (--frontends auto: see
    auto_frontends)."""
    replicas: int | None
    """Replica count; None means the number of GPUs, else 1. On CPU: that many logical CPU devices."""
    max_batch_size: int
    """Row budget of one model execution (all replicas together)."""
    batch_timeout_ms: float | None
    """Longest wait for more rows once a batch's oldest row is queued; 0 never waits, None (auto,
    the default) waits at most a batch's fixed cost, and only while rows come faster than one per
    fixed cost (see server.core.batching_policy for the three rules)."""
    max_inflight_batches: int
    """Batches executing at once (TF Serving's num_batch_threads); while they run, the next batch
    keeps filling. Default 1: TensorFlow already spreads one batch over every core, so on a CPU a
    second batch beside it competes for the same cores, and handing it to another thread of the
    model worker costs a wake-up per batch (measured in docs/performance.md). A GPU, whose host
    side can prepare the next batch while one computes, may gain from 2."""
    allowed_batch_sizes: tuple[int, ...]
    """Sizes a batch is padded up to (TF Serving's allowed_batch_sizes); empty: no padding."""
    batching_parameters_file: str | None
    """TF Serving's BatchingParameters text file; its fields override the batching flags."""
    intra_op_threads: int
    """TensorFlow threads inside one op; 0 lets TensorFlow choose (the number of cores)."""
    inter_op_threads: int
    """TensorFlow threads running independent ops at once; 0 lets TensorFlow choose."""
    max_queued_rows: int
    """Rows allowed to wait; beyond it requests are refused at once with RESOURCE_EXHAUSTED."""
    metrics_port: int
    """A separate HTTP port for Prometheus /metrics alone (it is on the REST port anyway); 0 picks
    a free one, -1 (the default) opens none."""
    max_message_bytes: int
    """Largest gRPC message accepted or sent, and largest REST body accepted."""
    request_bytes_budget: int
    """Bytes of requests held at once, all front-ends together: a message or body past it is
    refused on arrival, before it is read (REST) or decoded (gRPC). A request alone always passes."""
    drain_delay_s: float
    """After SIGTERM/SIGINT: keep accepting this long (health already NOT_SERVING) so load
    balancers can take the pod out, before refusing new RPCs."""
    grace_period_s: float
    """After SIGTERM/SIGINT: exit (0) within this long, having finished every accepted request."""
    log_format: str
    """text or json."""
    log_level: str
    max_concurrent_rpcs: int
    """RPCs handled at once; beyond it gRPC refuses with RESOURCE_EXHAUSTED (bounds memory)."""
    tls_cert_file: str | None
    """PEM certificate chain for server TLS (with tls_key_file)."""
    tls_key_file: str | None
    tls_client_ca_file: str | None
    """PEM CA bundle; when set, clients must present a certificate signed by it (mutual TLS)."""
    grpc_max_connection_age_ms: int
    """Close each client connection (GOAWAY) after about this long, so clients reconnect and spread
    over pods added since; 0 (the default) keeps connections for as long as clients like."""
    grpc_max_connection_age_grace_ms: int
    """After that GOAWAY, how long calls already on the old connection may take to finish."""
    event_loop: str
    """uvloop (the default: less CPU per request) or asyncio (the standard library's loop)."""
    grpc_bind_address: str
    """Address the gRPC port listens on; empty (the default) for every interface."""
    rest_bind_address: str
    """Address the HTTP port (and --metrics-port) listens on; empty (the default) for every interface."""
    grpc_max_concurrent_streams: int
    """HTTP/2 streams one client connection may have open at once; with grpc's overload protection,
    streams a client resets still count until freed, which is what stops a rapid-reset flood."""
    grpc_max_pending_rpcs: int
    """Calls grpc holds that the server has not yet picked up (grpc.server.max_pending_requests);
    grpc cancels more (CANCELLED), a growing share up to twice this and all beyond. 0 (the default)
    is 4 x max_concurrent_rpcs, so that a burst of several times the limit reaches the server's own
    refusal, RESOURCE_EXHAUSTED, which clients know to retry later."""
    enable_model_management: bool
    """Whether calls that change the served models (HandleReloadConfigRequest) are allowed at all;
    off by default, when they are PERMISSION_DENIED."""
    admin_token_file: str | None
    """Who may manage models: tokens calls must carry (authorization: Bearer TOKEN), one per line,
    optionally 'NAME TOKEN' to log a name; and 'client-certificate NAME' lines naming admins'
    client certificates (subject common name or subjectAltName) under mutual TLS."""
    model_roots: tuple[str, ...]
    """Folders a model management call may point a base path into (symlinks resolved); empty: the
    folders holding the start-up models."""
    rest_api_timeout_ms: float
    """A REST request's deadline when it sends none (TF Serving's rest_api_timeout_in_ms); 0: none."""
    monitoring_config_file: str | None
    """TF Serving's MonitoringConfig text file: whether the REST port serves the metrics, and at
    which path; without it, /metrics and /monitoring/prometheus/metrics."""
    model_warmup: bool = True
    """Replay each version's warmup file (assets.extra/tf_serving_warmup_requests) before it serves."""
    warmup_iterations: int = 1
    """Times each warmup record is run (TF Serving's num_request_iterations_for_warmup)."""
    batching: bool = True
    """Merge concurrent requests into batches (this server's default; TF Serving batches only with
    --enable_batching). Off: each request runs alone, whole, split over the replicas as one batch."""
    tensor_content_outputs: bool = False
    """Predict answers with numbers packed in tensor_content (TF Serving's
    --enable_serialization_as_tensor_content); by default each dtype's typed field (float_val,
    int64_val, ...), which TF Serving's example clients read."""
    strict_warm_up: bool = True
    """A version whose signatures fail on the generated warm-up rows (every batch size it will run,
    on zeros) does not serve: its load fails, saying why. Off, that failure is a warning. A version
    with its own warmup file is judged by that file's requests instead."""
    signature_method_name_check: bool = False
    """Classify and Regress only on signatures whose method_name says so (TF Serving's
    enable_signature_method_name_check); off, a signature of the right shape serves whatever its
    method_name, as TF2 exports every signature as predict."""
    ssl_config_file: str | None = None
    """TF Serving's SSLConfig text file (PEM texts inline): TLS on the gRPC port only, as in TF Serving."""
    request_log_file_bytes: int = 64 * 1024 * 1024
    """A request log file is closed, and the next one opened, once it holds this many bytes."""
    request_log_max_files: int = 16
    """Request log files kept per model; older ones are deleted (disk use stays bounded)."""
    target_latency_ms: float | None = None
    """Every model's latency target unless its batching_parameters say otherwise
    (server.core.latency_target); None: none."""
    hang_timeout_s: float = 30.0
    """Least time a batch may run before the model worker counts as hung (server.core.watchdog: the
    limit is the larger of this and 20 x the version's p99 batch time, 3 x this for its first 20
    batches); then the server drains and exits 1. 0: never."""
    admin_client_ca_file: str | None = None
    """PEM CA certificates: client certificates they issued directly may manage models (mutual TLS);
    they are trusted for the handshake beside tls_client_ca_file's."""
    tracing: str = "off"
    """off, or otlp: OpenTelemetry traces exported over OTLP/gRPC (server.tracing; the SDK's OTEL_*
    environment variables configure the endpoint, sampler, service name and resource)."""
    flag_warnings: tuple[str, ...] = ()
    """TF Serving flags accepted and ignored (server.tfs_flags), logged at start."""

    @property
    def tls_mode(self) -> str:
        if self.ssl_config_file is not None:
            return "grpc-only (--ssl-config-file)"
        if self.tls_cert_file is None:
            return "off"
        return "mutual" if self.tls_client_ca_file else "server"

    @property
    def batch_timeout_s(self) -> float | None:
        return None if self.batch_timeout_ms is None else self.batch_timeout_ms / 1000.0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _timeout_ms(text: str) -> float | None:
    return None if text.strip().lower() == "auto" else _non_negative_float(text)


def batch_sizes_problem(sizes: tuple[int, ...], max_batch_size: int | None, *,
                        sizes_name: str = "allowed_batch_sizes", max_name: str = "max_batch_size") -> str | None:
    """What is wrong with a list of allowed batch sizes, or None: the one rule that the flags, a
    batching parameters file, a model's config and the batcher all apply (TF Serving's): positive,
    increasing, and the last one is the max batch size (not checked when max_batch_size is None)."""
    if not sizes:
        return None
    if sizes[0] < 1 or any(b <= a for a, b in itertools.pairwise(sizes)):
        return f"{sizes_name} must be positive and increasing, got {list(sizes)}"
    if max_batch_size is not None and sizes[-1] != max_batch_size:
        return f"the last of {sizes_name} ({sizes[-1]}) must equal {max_name} ({max_batch_size})"
    return None


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if batch_sizes_problem(sizes, None):
        raise argparse.ArgumentTypeError(f"must be positive and increasing, got {text!r}")
    return sizes


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0 = any free port), got {value}")
    return value


def _optional_port(text: str) -> int:
    return -1 if int(text) == -1 else _port(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m server",
        description="Serve TensorFlow SavedModels over TensorFlow Serving's gRPC and REST APIs and the Open Inference "
                    "Protocol v2 (gRPC and REST).",
        epilog=f"Each flag may also be set as an environment variable {ENV_PREFIX}<FLAG_NAME>, "
        f"e.g. {ENV_PREFIX}MAX_BATCH_SIZE=64.",
    )
    p.add_argument("--model-base-path", default=None,
                   help="one model: a folder with numeric version subfolders (BASE/1/saved_model.pb); "
                        "the highest version is served. Default: the built-in demo model")
    p.add_argument("--model-name", default=None,
                   help="name clients address (default: 'demo' for the demo model, "
                        "else the base folder's name)")
    p.add_argument("--model-config-file", default=None,
                   help="several models: a TensorFlow Serving ModelServerConfig text file (names, base paths, "
                        "version policies, labels); replaces --model-base-path/--model-name")
    p.add_argument("--model-repository", default=None, metavar="DIR",
                   help="several models, Triton's way: every subfolder of DIR is a model named after it, its "
                        "versions in TF Serving's layout (DIR/NAME/1/saved_model.pb); replaces --model-base-path")
    p.add_argument("--model-control-mode", choices=("none", "explicit"), default="none",
                   help="with --model-repository: none (default) serves every model there from the start and "
                        "refuses load/unload calls; explicit serves --load-model's and what load calls ask for")
    p.add_argument("--load-model", dest="load_models", action="append", default=None, metavar="NAME",
                   help="in explicit mode, a model of --model-repository to serve from the start (repeatable; "
                        "'*' for all)")
    p.add_argument("--file-system-poll-wait-seconds", type=_non_negative_float, default=1.0,
                   help="re-read version folders this often to load new versions and unload removed ones "
                        "(default 1; 0 = read once)")
    p.add_argument("--model-config-file-poll-wait-seconds", type=_non_negative_float, default=0.0,
                   help="re-read --model-config-file this often and apply it when it changed (default 0: once)")
    p.add_argument("--port", type=_port, default=8500, help="gRPC port (default 8500; 0 = any free port)")
    p.add_argument("--rest-api-port", type=_optional_port, default=8501,
                   help="HTTP port: TF Serving's REST API (/v1), the Open Inference Protocol's (/v2) and "
                        "Prometheus /metrics (default 8501; 0 = any free port; -1 = no HTTP)")
    p.add_argument("--frontends", type=_frontends, default="auto", metavar="N|auto",
                   help="front-end processes answering gRPC and REST on the same ports, all feeding the one "
                        "model worker (auto, the default: " + AUTO_FRONTENDS_HELP + ")")
    p.add_argument("--replicas", type=_positive_int, default=None,
                   help="number of replicas (default: number of GPUs, else 1; on CPU, logical CPU devices)")
    p.add_argument("--max-batch-size", type=_positive_int, default=64,
                   help="rows per model execution, across all replicas (default 64)")
    p.add_argument("--batch-timeout-ms", type=_timeout_ms, default=None, metavar="MS|auto",
                   help="longest wait for more rows after a batch's oldest row is queued; 0 = never wait; "
                        "auto (default) = at most a batch's fixed cost (its time that does not grow with "
                        "rows), only while rows come faster than that")
    p.add_argument("--max-inflight-batches", type=_positive_int, default=1,
                   help="batches executing at once, each on its own warmed-up thread of the model worker "
                        "(TF Serving's num_batch_threads; default 1)")
    p.add_argument("--allowed-batch-sizes", type=_batch_sizes, default=(), metavar="N,N,...",
                   help="pad each batch up to the next of these sizes (increasing, the last equal to "
                        "--max-batch-size), so the model only sees them; default: no padding")
    p.add_argument("--batching-parameters-file", "--batching_parameters_file", default=None,
                   help="TF Serving's BatchingParameters text file (max_batch_size, batch_timeout_micros, "
                        "num_batch_threads, max_enqueued_batches, allowed_batch_sizes); overrides the flags")
    p.add_argument("--intra-op-threads", type=_non_negative_int, default=0,
                   help="TensorFlow intra-op threads (default 0: TensorFlow's choice, one per core)")
    p.add_argument("--inter-op-threads", type=_non_negative_int, default=0,
                   help="TensorFlow inter-op threads (default 0: TensorFlow's choice); with one CPU replica, "
                        "most models' ops run on the batch's own thread instead")
    p.add_argument("--max-queued-rows", type=_positive_int, default=4096,
                   help="rows allowed to wait; more are refused with RESOURCE_EXHAUSTED (default 4096)")
    p.add_argument("--metrics-port", type=_optional_port, default=-1,
                   help="a separate HTTP port for Prometheus /metrics only, which the REST port serves too "
                        "(default -1: none; 0 = any free port)")
    p.add_argument("--request-bytes-budget", type=_bytes_budget, default="auto", metavar="BYTES|auto",
                   help="bytes of requests held at once (bodies and messages being read, decoded or served), "
                        "over gRPC and REST together, shared by the front-ends; a request past it is refused "
                        "before it is read or decoded, RESOURCE_EXHAUSTED / 429 (auto, the default: 1/8 of the "
                        "container's memory limit, else 1 GiB)")
    p.add_argument("--max-message-bytes", type=_positive_int, default=64 * 1024 * 1024,
                   help="largest gRPC message received or sent, and largest REST body (default 64 MiB)")
    p.add_argument("--target-latency-ms", type=_positive_float, default=None, metavar="MS",
                   help="a p99 latency target for every model (a model's batching_parameters may set its own): "
                        "the server then chooses the batch size from the model's measured costs and the arrival "
                        "rate, and sheds requests that would miss it when it cannot keep up (default: none)")
    p.add_argument("--hang-timeout-s", type=_non_negative_float, default=30.0,
                   help="least time a batch may run before the model worker counts as hung: its requests get "
                        "UNAVAILABLE, liveness turns NOT_SERVING, and the server drains and exits 1 (the limit is "
                        "the larger of this and 20x the version's p99 batch time; 3x this for its first 20 "
                        "batches; default 30; 0: never)")
    p.add_argument("--drain-delay-s", type=_non_negative_float, default=2.0,
                   help="on SIGTERM/SIGINT keep accepting this long after health turns NOT_SERVING (default 2)")
    p.add_argument("--grace-period-s", type=_non_negative_float, default=25.0,
                   help="on SIGTERM/SIGINT finish accepted requests and exit within this long (default 25)")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="log line format (default text)")
    p.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), default="INFO",
                   help="least severe level logged (default INFO)")
    p.add_argument("--max-concurrent-rpcs", type=_positive_int, default=1024,
                   help="RPCs handled at once; more are refused with RESOURCE_EXHAUSTED (default 1024)")
    p.add_argument("--tls-cert-file", default=None, help="PEM certificate (chain) to serve TLS with")
    p.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    p.add_argument("--tls-client-ca-file", default=None,
                   help="PEM CA bundle; clients must present a certificate it signed (mutual TLS)")
    p.add_argument("--grpc-max-connection-age-ms", type=_non_negative_int, default=0,
                   help="close client connections after about this long so clients re-balance over pods "
                        "(default 0: never)")
    p.add_argument("--grpc-max-connection-age-seconds", type=float, default=None, metavar="S",
                   help="the same in seconds (grpc's max_connection_age), e.g. 60 so that long-lived clients are "
                        "re-spread over front-ends and pods")
    p.add_argument("--grpc-max-connection-age-grace-ms", type=_non_negative_int, default=10_000,
                   help="time calls on a closing connection get to finish (default 10000)")
    p.add_argument("--tracing", choices=("off", "otlp"), default="off",
                   help="otlp: OpenTelemetry traces of requests and batches, exported over OTLP/gRPC and "
                        "configured by the SDK's OTEL_* variables (OTEL_EXPORTER_OTLP_ENDPOINT, "
                        "OTEL_TRACES_SAMPLER, OTEL_SERVICE_NAME, ...); default off")
    p.add_argument("--event-loop", choices=event_loop.NAMES, default=event_loop.NAMES[0],
                   help="event loop that runs gRPC, batching and metrics: uvloop (default; less CPU per "
                        "request) or asyncio (the standard library's)")
    p.add_argument("--grpc-bind-address", default="", metavar="ADDRESS",
                   help="address the gRPC port listens on (default: every interface)")
    p.add_argument("--rest-bind-address", default="", metavar="ADDRESS",
                   help="address the HTTP port and --metrics-port listen on (default: every interface)")
    p.add_argument("--grpc-max-concurrent-streams", type=_positive_int, default=256,
                   help="HTTP/2 streams one gRPC connection may have open at once; streams a client resets "
                        "count until freed, which throttles a rapid-reset flood (default 256)")
    p.add_argument("--grpc-max-pending-rpcs", type=_non_negative_int, default=0, metavar="N",
                   help="calls grpc queues before the server picks them up; grpc cancels more (CANCELLED), "
                        "some up to 2N and all beyond (default 0: 4 x --max-concurrent-rpcs)")
    p.add_argument("--enable-model-management", action="store_true", default=False,
                   help="allow calls that change the served models (ModelService/HandleReloadConfigRequest); "
                        "each must carry a token of --admin-token-file, or come over mutual TLS (default: off, "
                        "such calls are PERMISSION_DENIED)")
    p.add_argument("--admin-token-file", default=None, metavar="FILE",
                   help="who may manage models: tokens calls must carry as 'authorization: Bearer TOKEN', one per "
                        "line, optionally 'NAME TOKEN' (the name is logged, never the token); and under mutual TLS "
                        "'client-certificate NAME' lines, a client certificate's subject common name or "
                        "subjectAltName")
    p.add_argument("--admin-client-ca-file", default=None, metavar="FILE",
                   help="PEM CA certificates whose directly issued client certificates may manage models over "
                        "mutual TLS (they may also connect, beside --tls-client-ca-file's)")
    p.add_argument("--model-root", dest="model_roots", action="append", default=None, metavar="DIR",
                   help="a folder model management calls may point base paths into, symlinks resolved "
                        f"(repeatable; in the environment, separated by '{os.pathsep}'; default: the folders "
                        "holding the start-up models)")
    p.add_argument("--rest-api-timeout-ms", type=_non_negative_float, default=0.0, metavar="MS",
                   help="a REST request's deadline when it sends none (Grpc-Timeout or v2 timeout); "
                        "default 0: none")
    p.add_argument("--monitoring-config-file", default=None, metavar="FILE",
                   help="TF Serving's MonitoringConfig text file (prometheus_config { enable path }): whether "
                        "the REST port serves the metrics, and where (default: /metrics and "
                        "/monitoring/prometheus/metrics)")
    p.add_argument("--model-warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="replay each version's assets.extra/tf_serving_warmup_requests (TF Serving's warmup "
                        "file) before it serves (default: on; --no-model-warmup skips them)")
    p.add_argument("--warmup-iterations", type=_positive_int, default=1, metavar="N",
                   help="times each warmup record is run (default 1)")
    p.add_argument("--batching", action=argparse.BooleanOptionalAction, default=True,
                   help="merge concurrent requests into batches (default: on; TF Serving batches only with "
                        "--enable_batching); --no-batching: each request runs alone and whole, split over the "
                        "replicas as one batch (a model's batching_parameters { max_batch_size { value: 0 } } "
                        "says the same for it)")
    p.add_argument("--tensor-content-outputs", action=argparse.BooleanOptionalAction, default=False,
                   help="Predict answers with numbers in tensor_content (TF Serving's "
                        "--enable_serialization_as_tensor_content); default: in each dtype's typed field "
                        "(float_val, int64_val, ...), as TF Serving answers and its example clients read")
    p.add_argument("--strict-warm-up", action=argparse.BooleanOptionalAction, default=True,
                   help="a version that fails on the generated warm-up rows (zeros, each batch size) does not "
                        "serve, and its status says why (default: on; a version with a warmup file is judged "
                        "by that file instead; --no-strict-warm-up logs the failure and serves)")
    p.add_argument("--signature-method-name-check", action=argparse.BooleanOptionalAction, default=False,
                   help="Classify and Regress only on signatures whose method_name is tensorflow/serving/classify "
                        "or .../regress (default: off, as in TF Serving: a signature of the right inputs and "
                        "outputs serves, as TF2 exports every signature as predict)")
    p.add_argument("--ssl-config-file", default=None, metavar="FILE",
                   help="TF Serving's SSLConfig text file (server_key, server_cert, custom_ca: PEM texts; "
                        "client_verify): TLS on the gRPC port only, as in TF Serving")
    p.add_argument("--request-log-file-bytes", type=_positive_int, default=64 * 1024 * 1024, metavar="BYTES",
                   help="size at which a request log file (a model's logging_config) is closed and the next "
                        "opened (default 64 MiB)")
    p.add_argument("--request-log-max-files", type=_positive_int, default=16, metavar="N",
                   help="request log files kept per model; older ones are deleted (default 16)")
    p.add_argument("--version", action="version", version=f"mirrorserve {server_version()}",
                   help="print the version and exit")
    return p


def server_version() -> str:
    """This package's version (what --version and the v2 ServerMetadata say)."""
    try:
        return importlib.metadata.version("mirrorserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _env_name(action: argparse.Action) -> str:
    if isinstance(action, argparse._AppendAction):  # --model-root: MIRRORSERVE_MODEL_ROOT
        return ENV_PREFIX + action.option_strings[0].lstrip("-").replace("-", "_").upper()
    return ENV_PREFIX + action.dest.upper()


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _from_environment(action: argparse.Action, raw: str) -> object:
    """A flag's value from its environment variable: switches take true/false, repeatable flags a
    list separated like PATH."""
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        if raw.strip().lower() not in _TRUE + _FALSE:
            raise ValueError(f"must be one of {', '.join(_TRUE + _FALSE[:-1])}")
        return raw.strip().lower() in _TRUE
    if isinstance(action, argparse._AppendAction):
        return [part for part in raw.split(os.pathsep) if part]
    return action.type(raw) if callable(action.type) else raw


AUTO_FRONTENDS_HELP = "1 up to 2 usable cores, else one per 2 cores, at most 8"
AUTO_FRONTENDS_MAX = 8


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> float:
    """The cores this process may use: its CPU affinity, capped by a container's CPU quota (cgroup
    v2 cpu.max or v1 cpu.cfs_quota_us), which the affinity does not show."""
    cores = float(len(os.sched_getaffinity(0)))
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, int(quota) / int(period))
    except (OSError, ValueError):
        try:
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
            if int(quota) > 0:
                cores = min(cores, int(quota) / int(period))
        except (OSError, ValueError):
            pass
    return cores


def auto_frontends(cores: float) -> int:
    """--frontends auto: one front-end up to 2 usable cores, else one per 2 cores, at most
    AUTO_FRONTENDS_MAX. Why: one front-end saturates one core, and N of them only pay off with
    cores to spare beside the model worker and the clients. On 2 cores (docs/performance.md) 2
    front-ends matched 1 (0.91-1.05x req/s at 64 callers) at 20-35% more front-end CPU a request:
    smaller batches per front-end, and metrics written to shared files. Above 2 cores, half of them
    leaves the other half to the worker's threads (not measured yet on such a machine)."""
    if cores <= 2:
        return 1
    return max(1, min(AUTO_FRONTENDS_MAX, math.floor(cores / 2)))


BYTES_BUDGET_SHARE = 8
"""--request-bytes-budget auto: this share of the container's memory limit. The limit covers the
model worker (TensorFlow, the models, their batches) beside the front-ends, and a request's bytes
may take 2-3 times their size while held and decoded (the body, its tensors, the batch's copy)."""
BYTES_BUDGET_DEFAULT = 1 << 30
"""--request-bytes-budget auto without a memory limit: 1 GiB (16 messages of the largest size)."""


def memory_limit(cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The container's memory limit in bytes (cgroup v2 memory.max, or v1 memory.limit_in_bytes),
    or None without one."""
    for path in (cgroup / "memory.max", cgroup / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        return value if value < 1 << 60 else None  # v1 says "unlimited" with a huge number
    return None


def auto_bytes_budget(limit: int | None) -> int:
    return BYTES_BUDGET_DEFAULT if limit is None else max(limit // BYTES_BUDGET_SHARE, 1 << 20)


def _bytes_budget(text: str) -> int | str:
    if text == "auto":
        return text
    return _positive_int(text)


def _frontends(text: str) -> int | str:
    if text == "auto":
        return text
    value = int(text)
    if not 1 <= value <= 64:
        raise argparse.ArgumentTypeError(f"must be 1 to 64 or auto, got {text}")
    return value


def parse_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Parse flags, filling any flag not given from MIRRORSERVE_* variables."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    try:  # TF Serving's own flag names (server.tfs_flags) first
        argv, flag_warnings = tfs_flags.translate(sys.argv[1:] if argv is None else argv)
    except tfs_flags.FlagError as exc:
        parser.error(str(exc))
    env_defaults = {}
    for action in parser._actions:
        if action.dest in ("help", "version"):
            continue
        raw = environ.get(_env_name(action))
        if raw is None:
            continue
        try:
            env_defaults[action.dest] = _from_environment(action, raw)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            parser.error(f"{_env_name(action)}={raw!r}: {exc}")
    appended = {a.dest for a in parser._actions if isinstance(a, argparse._AppendAction)}
    parser.set_defaults(**{k: v for k, v in env_defaults.items() if k not in appended})
    ns = parser.parse_args(argv)
    for dest in appended:  # argparse would add command-line values to the default list: the line wins
        if getattr(ns, dest) is None:
            setattr(ns, dest, env_defaults.get(dest))
    if (ns.tls_cert_file is None) != (ns.tls_key_file is None):
        parser.error("--tls-cert-file and --tls-key-file go together")
    if ns.tls_client_ca_file is not None and ns.tls_cert_file is None:
        parser.error("--tls-client-ca-file (mutual TLS) needs --tls-cert-file and --tls-key-file")
    if ns.ssl_config_file is not None and ns.tls_cert_file is not None:
        parser.error("--ssl-config-file (--ssl_config_file) and --tls-cert-file both set TLS; give one")
    if ns.drain_delay_s >= ns.grace_period_s:
        parser.error(f"--drain-delay-s ({ns.drain_delay_s}) must be shorter than --grace-period-s "
                     f"({ns.grace_period_s})")
    fixed = [(flag, port) for flag, port in (("--port", ns.port), ("--rest-api-port", ns.rest_api_port),
                                             ("--metrics-port", ns.metrics_port)) if port > 0]
    for index, (flag, port) in enumerate(fixed):
        for other, other_port in fixed[index + 1:]:
            if port == other_port:
                parser.error(f"{flag} and {other} are both {port}; each needs its own port")
    problem = batch_sizes_problem(ns.allowed_batch_sizes, ns.max_batch_size,
                                  sizes_name="--allowed-batch-sizes", max_name="--max-batch-size")
    if problem:
        parser.error(problem)
    for flag, dest in (("--model-base-path", "model_base_path"), ("--model-repository", "model_repository")):
        if getattr(ns, dest) is not None:
            try:  # file:// is a local folder; another scheme (gs://, s3://) stops the start, saying why
                setattr(ns, dest, local_path(getattr(ns, dest), flag))
            except ValueError as exc:
                parser.error(str(exc))
    if ns.model_config_file is not None and (ns.model_base_path is not None or ns.model_name is not None):
        parser.error("--model-config-file replaces --model-base-path and --model-name; give one or the other")
    if ns.model_repository is not None and (ns.model_config_file is not None or ns.model_base_path is not None
                                            or ns.model_name is not None):
        parser.error("--model-repository replaces --model-config-file, --model-base-path and --model-name; "
                     "give one of them")
    if ns.model_control_mode == "explicit" and ns.model_repository is None:
        parser.error("--model-control-mode explicit loads models of --model-repository; give it too")
    ns.load_models = tuple(ns.load_models or ())
    if ns.grpc_max_connection_age_seconds is not None:
        if ns.grpc_max_connection_age_seconds < 0:
            parser.error("--grpc-max-connection-age-seconds must be >= 0")
        if ns.grpc_max_connection_age_ms:
            parser.error("--grpc-max-connection-age-seconds and --grpc-max-connection-age-ms are one setting; give one")
        ns.grpc_max_connection_age_ms = round(ns.grpc_max_connection_age_seconds * 1000)
    if ns.frontends == "auto":
        ns.frontends = auto_frontends(usable_cores())
    if ns.request_bytes_budget == "auto":
        ns.request_bytes_budget = auto_bytes_budget(memory_limit())
    if ns.load_models and ns.model_control_mode != "explicit":
        parser.error("--load-model picks the models explicit mode starts with; give --model-control-mode explicit "
                     "(in mode none every model of the repository is served)")
    if ns.model_config_file is not None or ns.model_repository is not None:
        ns.model_name = ""
    elif ns.model_name is None:
        ns.model_name = (
            "demo" if ns.model_base_path is None
            else os.path.basename(os.path.normpath(ns.model_base_path))
        )
    ns.model_roots = tuple(ns.model_roots or ())
    if ns.admin_token_file is not None and not ns.enable_model_management:
        parser.error("--admin-token-file is for model management calls; give --enable-model-management too")
    if ns.admin_client_ca_file is not None and (not ns.enable_model_management or ns.tls_client_ca_file is None):
        parser.error("--admin-client-ca-file names who may manage models over mutual TLS; give "
                     "--enable-model-management and --tls-client-ca-file too")
    if ns.enable_model_management and ns.admin_token_file is None and ns.admin_client_ca_file is None:
        parser.error("--enable-model-management needs a credential: --admin-token-file (tokens, or admins' client "
                     "certificates by name), or --admin-client-ca-file")
    fields = {f.name for f in dataclasses.fields(Settings)}
    return Settings(**{k: v for k, v in vars(ns).items() if k in fields}, flag_warnings=tuple(flag_warnings))
