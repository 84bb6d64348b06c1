"""TF Serving's --monitoring_config_file: whether the REST port serves the Prometheus metrics, and at
which path (`prometheus_config { enable: true path: "/monitoring/prometheus/metrics" }`), read as TF
Serving reads it. Without the file the server keeps its own: /metrics and TF Serving's path."""

from __future__ import annotations

from protos.tensorflow_serving import monitoring_config_pb2
from server.frontends import text_proto

TF_SERVING_PATH = "/monitoring/prometheus/metrics"
DEFAULT_PATHS = ("/metrics", TF_SERVING_PATH)


def metrics_paths(config_file: str | None) -> tuple[str, ...]:
    """The REST paths that serve the metrics; ValueError (the server exits 2) names what is wrong
    with the file."""
    if config_file is None:
        return DEFAULT_PATHS
    config = text_proto.read(config_file, monitoring_config_pb2.MonitoringConfig, "--monitoring_config_file")
    prometheus = config.prometheus_config
    if not prometheus.enable:
        return ()
    path = prometheus.path or TF_SERVING_PATH
    if not path.startswith("/") or any(c.isspace() for c in path):
        raise ValueError(f"--monitoring_config_file {config_file}: path '{path[:80]}' must start with / and hold "
                         f"no spaces")
    return (path,)
