"""TF Serving's --monitoring_config_file: whether the REST port serves the Prometheus metrics, and at
which path (`prometheus_config { enable: true path: "/monitoring/prometheus/metrics" }`), read as TF
Serving reads it. Without the file the server keeps its own: /metrics and TF Serving's path."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format

from protos.tensorflow_serving import monitoring_config_pb2

TF_SERVING_PATH = "/monitoring/prometheus/metrics"
DEFAULT_PATHS = ("/metrics", TF_SERVING_PATH)


def metrics_paths(config_file: str | None) -> tuple[str, ...]:
    """The REST paths that serve the metrics; ValueError (the server exits 2) names what is wrong
    with the file."""
    if config_file is None:
        return DEFAULT_PATHS
    try:
        text = Path(config_file).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read --monitoring_config_file {config_file}: {exc.strerror or exc}") from None
    config = monitoring_config_pb2.MonitoringConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ValueError(f"--monitoring_config_file {config_file} is not a MonitoringConfig: {exc}") from None
    prometheus = config.prometheus_config
    if not prometheus.enable:
        return ()
    path = prometheus.path or TF_SERVING_PATH
    if not path.startswith("/") or any(c.isspace() for c in path):
        raise ValueError(f"--monitoring_config_file {config_file}: path '{path[:80]}' must start with / and hold "
                         f"no spaces")
    return (path,)
