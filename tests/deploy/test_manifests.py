"""The kustomize overlays render, every object validates against the Kubernetes schemas offline,
and the pieces agree with each other and with the server: ports, probes, grace periods, labels,
the autoscaler's custom metric, the GPU count."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from server.config import ENV_PREFIX, build_parser, parse_settings
from server.core.model_config import parse_config_text
from tests.deploy.conftest import (
    DEPLOY,
    OVERLAYS,
    container,
    env_value,
    final_stage,
    image_env,
    kustomize,
    one,
    render,
)

KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
"""The newest release kubernetes-validate ships schemas for, and an older one still in use."""


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def test_every_rendered_object_validates(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PersistentVolumeClaim",
                     "PodDisruptionBudget", "Service", "Service"]
    for version in KUBERNETES_VERSIONS:
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)


def test_validation_would_catch_a_broken_object(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """The validator is not a no-op: a misspelt probe field is refused."""
    _, objects = rendered
    broken = yaml.safe_load(yaml.safe_dump(one(objects, "Deployment")))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 8500
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_grace_period_arithmetic(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    main = container(objects)
    drain = float(env_value(main, "MIRRORSERVE_DRAIN_DELAY_S"))
    grace = float(env_value(main, "MIRRORSERVE_GRACE_PERIOD_S"))
    assert drain > 0, "with no drain delay, calls routed before endpoint removal propagates are refused"
    assert drain + grace < pod["terminationGracePeriodSeconds"]


def test_every_environment_variable_is_a_server_flag(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """A misspelt MIRRORSERVE_ variable would be ignored silently; the server accepts all of them."""
    _, objects = rendered
    main = container(objects)
    flags = {ENV_PREFIX + a.dest.upper() for a in build_parser()._actions if a.dest != "help"}
    names = {var["name"] for var in main["env"]}
    assert names <= flags, names - flags
    image = {name for name in image_env() if name.startswith(ENV_PREFIX)}
    assert image <= flags | {ENV_PREFIX + "CACHE_DIR"}, image - flags
    plain = {var["name"]: var["value"] for var in main["env"] if "value" in var}
    settings = parse_settings([], environ=plain)  # exits on a bad value
    assert settings.drain_delay_s < settings.grace_period_s


def test_probes_are_grpc_health_checks_on_the_serving_port(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    main = container(objects)
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports == {"grpc": int(env_value(main, "MIRRORSERVE_PORT")),
                     "http": int(env_value(main, "MIRRORSERVE_REST_API_PORT")),
                     "metrics": int(env_value(main, "MIRRORSERVE_METRICS_PORT"))}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["grpc"]["port"] == ports["grpc"], probe
    for probe in ("startupProbe", "readinessProbe"):
        assert main[probe].get("grpc", {}).get("service", "") == "", "the overall health ('') says SERVING"
    assert main["livenessProbe"]["grpc"]["service"] == "liveness", "liveness: the worker makes progress"
    startup = main["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "room to load a large model"
    annotations = one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"], "scraped outside the API's admission limit"
    assert annotations["prometheus.io/path"] == "/metrics"


def test_pod_runs_locked_down(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    main = container(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    user = next(args for instruction, args in final_stage() if instruction == "USER")
    assert str(pod["securityContext"]["runAsUser"]) == user.split(":")[0], "pod and image agree on the user"
    security = main["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert mounts["models"]["readOnly"] is True
    assert mounts["tmp"]["mountPath"] == "/tmp", "the only writable place"
    config_file = env_value(main, "MIRRORSERVE_MODEL_CONFIG_FILE")
    assert config_file.startswith(mounts["config"]["mountPath"] + "/") and mounts["config"]["readOnly"] is True
    assert "subPath" not in mounts["config"], "a subPath mount never sees ConfigMap updates"
    volumes = {v["name"]: v for v in pod["volumes"]}
    config_map = one(objects, "ConfigMap", volumes["config"]["configMap"]["name"])
    sources = parse_config_text(config_map["data"][Path(config_file).name])
    assert sources and all(s.base_path.startswith(mounts["models"]["mountPath"] + "/") for s in sources)
    assert "command" not in main and "args" not in main, "the image's entrypoint runs the server"


def test_services_reach_the_pods(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in container(objects)["ports"]}
    cluster_ip = one(objects, "Service", "mirrorserve")
    headless = one(objects, "Service", "mirrorserve-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert cluster_ip["spec"].get("type", "ClusterIP") == "ClusterIP"
    for service in (cluster_ip, headless):
        assert service["spec"]["selector"].items() <= labels.items()
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names
    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert int(env_value(container(objects), "MIRRORSERVE_GRPC_MAX_CONNECTION_AGE_MS")) > 0, \
        "long-lived connections through the ClusterIP Service must re-balance"


def test_autoscaler_metric_is_the_adapter_rule(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, objects = rendered
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(objects, "Deployment")["metadata"]["name"]
    assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Pods", "Pods"], overlay
    pods_metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert pods_metrics == ["mirrorserve_busy_share", "mirrorserve_queue_fill"], "busy share first"
    rules = yaml.safe_load((DEPLOY / "k8s" / "prometheus-adapter" / "rules.yaml").read_text())["rules"]
    assert [r["name"]["as"] for r in rules] == pods_metrics


def test_gpu_overlay_runs_one_replica_per_gpu() -> None:
    objects = render("gpu")
    main = container(objects)
    gpus = int(main["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus >= 1
    assert int(env_value(main, "MIRRORSERVE_REPLICAS")) == gpus
    assert main["image"].endswith(":gpu")
    cpu_main = container(render("cpu"))
    assert "nvidia.com/gpu" not in cpu_main["resources"]["limits"]
    assert cpu_main["image"].endswith(":cpu")
    # In both, TensorFlow's thread pools follow the pod's CPU limit.
    for each in (main, cpu_main):
        threads = {v["name"]: v["valueFrom"]["resourceFieldRef"] for v in each["env"] if "valueFrom" in v}
        assert threads == {name: {"containerName": each["name"], "resource": "limits.cpu"}
                           for name in ("MIRRORSERVE_INTRA_OP_THREADS", "MIRRORSERVE_INTER_OP_THREADS")}


def test_servicemonitor_component_selects_the_metrics_port(tmp_path: Path) -> None:
    overlay = tmp_path / "with-monitor"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        # kustomize takes only relative paths
        "resources": [os.path.relpath(DEPLOY / "k8s" / "overlays" / "cpu", overlay)],
        "components": [os.path.relpath(DEPLOY / "k8s" / "components" / "servicemonitor", overlay)],
    }))
    objects = kustomize(overlay)
    monitor = one(objects, "ServiceMonitor")
    service = one(objects, "Service", "mirrorserve")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["port"] == "metrics", "scraped on the metrics port, outside the API's admission limit"
    annotations = one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert endpoint["path"] == annotations["prometheus.io/path"]


def test_kserve_inference_service_runs_the_server_on_a_v2_grpc_port() -> None:
    """The KServe manifest: a custom predictor whose gRPC port Knative routes (named h2c), every
    variable a server flag, the config file from its own ConfigMap parsing as a model config."""
    objects = list(yaml.safe_load_all((DEPLOY / "kserve" / "inferenceservice.yaml").read_text()))
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    (service,) = [o for o in objects if o["kind"] == "InferenceService"]
    assert service["apiVersion"] == "serving.kserve.io/v1beta1"
    predictor = service["spec"]["predictor"]
    (main,) = predictor["containers"]
    env = {v["name"]: v["value"] for v in main["env"]}
    flags = {ENV_PREFIX + a.dest.upper() for a in build_parser()._actions if a.dest != "help"}
    assert set(env) <= flags, set(env) - flags
    (port,) = main["ports"]
    assert (port["name"], port["containerPort"]) == ("h2c", int(env["MIRRORSERVE_PORT"]))
    assert main["readinessProbe"]["grpc"]["port"] == port["containerPort"]
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    volumes = {v["name"]: v for v in predictor["volumes"]}
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert env["MIRRORSERVE_MODEL_CONFIG_FILE"].startswith(mounts["config"] + "/")
    sources = parse_config_text(config_map["data"][Path(env["MIRRORSERVE_MODEL_CONFIG_FILE"]).name])
    assert all(s.base_path.startswith(mounts["models"] + "/") for s in sources)


def test_request_log_retention_fits_the_pods_tmp(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """Each front-end keeps --request-log-max-files files of --request-log-file-bytes per logged
    model; /tmp (an emptyDir, which also holds the front-ends' metric files) must hold that for a
    few models at once."""
    from server.config import auto_frontends

    overlay, objects = rendered
    main = container(objects)
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    (tmp,) = [v for v in pod["volumes"] if v["name"] == "tmp"]
    size = tmp["emptyDir"]["sizeLimit"]
    assert size.endswith("Gi")
    frontends = auto_frontends(float(main["resources"]["limits"]["cpu"]))
    per_model = (frontends * int(env_value(main, "MIRRORSERVE_REQUEST_LOG_MAX_FILES"))
                 * int(env_value(main, "MIRRORSERVE_REQUEST_LOG_FILE_BYTES")))
    assert 3 * per_model <= int(size[:-2]) * 2**30, (overlay, frontends, per_model, size)


def test_the_byte_budget_and_message_size_fit_the_pods_memory(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    from server.api.http.server import JSON_HELD_FACTOR

    overlay, objects = rendered
    main = container(objects)
    memory = main["resources"]["limits"]["memory"]
    assert memory.endswith("Gi")
    budget = int(env_value(main, "MIRRORSERVE_REQUEST_BYTES_BUDGET"))
    largest = int(env_value(main, "MIRRORSERVE_MAX_MESSAGE_BYTES"))
    assert budget <= int(memory[:-2]) * 2**30 // 4, (overlay, budget, memory)  # the worker keeps the rest
    assert 2 * JSON_HELD_FACTOR * largest <= budget, "two of the largest JSON bodies fit at once"
