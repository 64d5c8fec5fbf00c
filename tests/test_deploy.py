"""Every file under deploy/ read by the tool that consumes it: kustomize renders the overlays,
kubernetes-validate checks the core objects strictly, the custom resources match their CRDs'
schemas, promtool checks and unit-tests the rules, and the dashboard's queries use the rules."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from app.settings import Settings
from tests.crd_schemas import BY_KIND
from tests.tools import require_tool

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
PROMETHEUS = DEPLOY / "prometheus"
OVERLAYS = ["cpu", "gpu", "repository"]
BIN = Path(sys.executable).parent  # tools installed in this virtual environment


def load_module(path: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rendered(overlay: str) -> list[dict[str, Any]]:
    kubectl = require_tool("kubectl")
    output = subprocess.run(
        [str(kubectl), "kustomize", str(KUBERNETES / "overlays" / overlay)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [document for document in yaml.safe_load_all(output) if document]


def by_kind(documents: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (document,) = [d for d in documents if d["kind"] == kind]
    return document


def validate_strictly(documents: list[dict[str, Any]], tmp_path: Path) -> None:
    """``kubernetes-validate --strict`` on core Kubernetes objects, as a user would run it."""
    path = tmp_path / "objects.yaml"
    path.write_text(yaml.safe_dump_all(documents))
    validate = require_tool(
        "kubernetes-validate", Path(sys.executable).parent / "kubernetes-validate"
    )
    result = subprocess.run([str(validate), "--strict", "--quiet", str(path)],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_render_and_the_core_objects_validate_strictly(
    overlay: str, tmp_path: Path
) -> None:
    documents = rendered(overlay)
    kinds = sorted(document["kind"] for document in documents)
    extra = ["PersistentVolumeClaim"] if overlay == "repository" else []
    assert kinds == sorted(["ConfigMap", "Deployment", "PodDisruptionBudget", "PrometheusRule",
                            "ScaledObject", "Service", "ServiceMonitor", *extra])  # fmt: skip
    validate_strictly([d for d in documents if d["kind"] not in BY_KIND], tmp_path)
    for document in documents:
        if document["kind"] in BY_KIND:
            jsonschema.validate(document, BY_KIND[document["kind"]])


def test_the_repository_overlay_mounts_the_models_read_only() -> None:
    documents = rendered("repository")
    pod = by_kind(documents, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "models"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "models"]
    settings = by_kind(documents, "ConfigMap")["data"]
    assert (mount["mountPath"], mount["readOnly"]) == ("/models", True)
    assert (
        volume["persistentVolumeClaim"]["claimName"]
        == by_kind(documents, "PersistentVolumeClaim")["metadata"]["name"]
    )
    assert settings["BATCHSERVE_MODEL_REPOSITORY"] == "/models"
    assert settings["BATCHSERVE_MODEL_CONTROL"] == "explicit"


def test_the_deployment_runs_safely_and_drains_before_it_is_killed() -> None:
    for overlay in OVERLAYS:
        documents = rendered(overlay)
        pod = by_kind(documents, "Deployment")["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        settings = by_kind(documents, "ConfigMap")["data"]
        drain = float(settings["BATCHSERVE_DRAIN_TIMEOUT_S"])
        pause = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pod["terminationGracePeriodSeconds"] > drain + pause
        assert container["startupProbe"]["httpGet"]["path"] == "/readyz"
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        # Readiness through Kubernetes' gRPC probe, on the port the server listens on.
        grpc_port = int(settings["BATCHSERVE_GRPC_PORT"])
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert ports == {"http": 8000, "grpc": grpc_port}
        assert container["readinessProbe"]["grpc"]["port"] == grpc_port
        service = by_kind(documents, "Service")["spec"]["ports"]
        assert {(port["name"], port["targetPort"]) for port in service} == {
            ("http", "http"), ("grpc", "grpc"),
        }  # fmt: skip
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
        assert {"/tmp", "/var/cache/batchserve"} <= mounts  # where the server writes
        assert settings["BATCHSERVE_ARTIFACTS_DIR"].startswith("/var/cache/batchserve/")
        assert container["envFrom"][0]["configMapRef"]["name"].startswith("batchserve-settings")
        key = container["env"][0]
        assert (key["name"], key["valueFrom"]["secretKeyRef"]["name"]) == (
            "BATCHSERVE_API_KEY", "batchserve-api-key"
        )  # fmt: skip
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        assert gpus == ("1" if overlay == "gpu" else None)


def test_the_alternative_hpa_and_kserve_files_validate(tmp_path: Path) -> None:
    hpa = yaml.safe_load((KUBERNETES / "hpa" / "horizontalpodautoscaler.yaml").read_text())
    validate_strictly([hpa], tmp_path)
    adapter = yaml.safe_load((KUBERNETES / "hpa" / "prometheus-adapter-rules.yaml").read_text())
    published = {rule["name"]["as"] for rule in adapter["rules"]}
    used = {metric["pods"]["metric"]["name"] for metric in hpa["spec"]["metrics"]}
    assert used <= published  # every metric the HPA asks for is one the adapter publishes
    service = yaml.safe_load((KUBERNETES / "kserve" / "inferenceservice.yaml").read_text())
    jsonschema.validate(service, BY_KIND["InferenceService"])


def test_a_misspelt_field_is_caught_by_the_custom_resource_schemas() -> None:
    scaled = by_kind(rendered("cpu"), "ScaledObject")
    scaled["spec"]["minReplicasCount"] = 2
    with pytest.raises(jsonschema.ValidationError, match="minReplicasCount"):
        jsonschema.validate(scaled, BY_KIND["ScaledObject"])


def test_promtool_checks_and_unit_tests_the_rules() -> None:
    promtool = require_tool("promtool")
    checked = subprocess.run([str(promtool), "check", "rules", str(PROMETHEUS / "rules.yaml")],
                             capture_output=True, text=True)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([str(promtool), "test", "rules", "rules.test.yaml"],
                            cwd=PROMETHEUS, capture_output=True, text=True)  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr
    rules = yaml.safe_load((PROMETHEUS / "rules.yaml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]
              if "alert" in rule}  # fmt: skip
    tests = (PROMETHEUS / "rules.test.yaml").read_text()
    assert {alert for alert in alerts if f"alertname: {alert}" in tests} == alerts


def recording_rules() -> set[str]:
    rules = yaml.safe_load((PROMETHEUS / "rules.yaml").read_text())
    return {rule["record"] for group in rules["groups"] for rule in group["rules"]
            if "record" in rule}  # fmt: skip


def dashboard_queries() -> list[str]:
    dashboard = json.loads((PROMETHEUS / "grafana-dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_the_dashboard_is_built_on_the_recording_rules() -> None:
    records = recording_rules()
    queries = dashboard_queries()
    assert queries
    for query in queries:
        used = set(re.findall(r"batchserve:[a-z0-9_:]+", query))
        assert used, f"{query} does not use a recording rule"
        assert used <= records, used - records


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_disruption_budget_selects_the_deployments_pods(overlay: str) -> None:
    documents = rendered(overlay)
    selector = by_kind(documents, "PodDisruptionBudget")["spec"].get("selector", {})
    pod_labels = by_kind(documents, "Deployment")["spec"]["template"]["metadata"]["labels"]
    # policy/v1: an empty or missing selector selects no pod, and the budget protects nothing.
    assert selector.get("matchLabels")
    assert selector["matchLabels"].items() <= pod_labels.items()


def test_the_rules_reach_the_cluster_and_cannot_drift_from_rules_yaml() -> None:
    render = load_module(DEPLOY / "prometheus" / "render.py")
    committed = (KUBERNETES / "base" / "prometheusrule.yaml").read_text()
    assert committed == render.render(), "run python deploy/prometheus/render.py"
    documents = rendered("cpu")
    rule = by_kind(documents, "PrometheusRule")
    source = yaml.safe_load((PROMETHEUS / "rules.yaml").read_text())
    assert rule["spec"]["groups"] == source["groups"]
    recorded = {r["record"] for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r}
    scaled = by_kind(documents, "ScaledObject")["spec"]
    queries = " ".join(trigger["metadata"]["query"] for trigger in scaled["triggers"])
    used = set(re.findall(r"batchserve:[a-z_:0-9]+", queries))
    assert used
    assert used <= recorded  # every recording rule KEDA reads is installed


def test_every_trigger_is_valid_with_the_fallback() -> None:
    scaled = by_kind(rendered("cpu"), "ScaledObject")["spec"]
    assert scaled["fallback"]["replicas"] >= 1
    # KEDA applies a fallback to AverageValue triggers only (and its webhook may refuse others).
    assert {t.get("metricType", "AverageValue") for t in scaled["triggers"]} == {"AverageValue"}


def test_kserve_waits_for_a_slow_start_before_liveness() -> None:
    service = yaml.safe_load((KUBERNETES / "kserve" / "inferenceservice.yaml").read_text())
    (container,) = service["spec"]["predictor"]["containers"]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http1": 8000, "h2c": 8001}
    assert container["readinessProbe"]["grpc"]["port"] == 8001


def test_supervisord_workers_neither_crash_loop_nor_share_ports() -> None:
    import configparser

    config = configparser.RawConfigParser()
    config.read(DEPLOY / "host" / "supervisord.conf")
    program = config["program:batchserve"]
    assert int(program["startsecs"]) > 0
    assert program["autorestart"] == "unexpected"
    assert "3" in program["exitcodes"].split(",")  # uvicorn's start-up failure is final
    bases = [int(b) for b in re.findall(r"\$\(\((\d+) \+ %\(process_num\)d\)\)",
                                        program["command"])]  # fmt: skip
    assert len(bases) == 2
    workers = Settings.model_fields["workers"].metadata
    most = max(m.le for m in workers if hasattr(m, "le"))
    ports = [base + index for base in bases for index in range(most)]
    assert len(set(ports)) == len(ports)
    assert max(ports) < 65536


def test_the_cuda_image_gets_onnxruntimes_gpu_build() -> None:
    """The CUDA image must swap onnxruntime (CPU only) for onnxruntime-gpu, and both the
    Dockerfile's and the deployment guide's build commands must say so."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG ONNXRUNTIME=onnxruntime\n" in dockerfile
    assert 'pip install "$ONNXRUNTIME==$version"' in dockerfile
    texts = [
        text.replace("\\\n", "")
        for text in (dockerfile, (ROOT / "docs" / "deployment.md").read_text())
    ]
    cuda = r"docker build -t batchserve:cuda[^\n]*"
    cuda_builds = [command for text in texts for command in re.findall(cuda, text)]
    assert len(cuda_builds) == 2
    assert all("ONNXRUNTIME=onnxruntime-gpu" in command for command in cuda_builds)


def test_the_image_carries_the_bytecode_of_the_code_it_serves(tmp_path: Path) -> None:
    """The image runs with a read-only root filesystem and PYTHONDONTWRITEBYTECODE, and uvicorn
    imports the application from /srv: the Dockerfile compiles every package it copies there,
    so that a start imports bytecode instead of compiling the application first."""
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    assert "PYTHONDONTWRITEBYTECODE=1" in dockerfile
    copied = re.findall(r"^COPY (\w+) \./\1$", dockerfile, re.MULTILINE)
    assert copied == ["app", "batching", "preprocessing"]
    (command,) = re.findall(r"python -m compileall [^&\n]*", dockerfile)
    for package in copied:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    subprocess.run([sys.executable, *command.split()[1:]], cwd=tmp_path, check=True)
    sources = [path for package in copied for path in (tmp_path / package).rglob("*.py")]
    uncompiled = [str(path) for path in sources
                  if not Path(importlib.util.cache_from_source(str(path))).is_file()]  # fmt: skip
    assert sources
    assert not uncompiled


def test_the_scale_to_zero_overlay_wakes_from_zero_on_a_shared_read_only_cache(
    tmp_path: Path,
) -> None:
    documents = rendered("scale-to-zero")
    kinds = sorted(document["kind"] for document in documents)
    # No ScaledObject of its own: the add-on makes one from the HTTPScaledObject.
    assert kinds == sorted(["ConfigMap", "Deployment", "HTTPScaledObject", "Job",
                            "PersistentVolumeClaim", "PodDisruptionBudget", "PrometheusRule",
                            "Service", "ServiceMonitor"])  # fmt: skip
    validate_strictly([d for d in documents if d["kind"] not in BY_KIND], tmp_path)
    scaler = by_kind(documents, "HTTPScaledObject")
    jsonschema.validate(scaler, BY_KIND["HTTPScaledObject"])
    settings = by_kind(documents, "ConfigMap")["data"]
    batch = int(settings["BATCHSERVE_MAX_BATCH_SIZE"])
    spec = scaler["spec"]
    assert spec["replicas"]["min"] == 0
    assert spec["scalingMetric"]["concurrency"]["targetValue"] == 2 * batch
    deployment = by_kind(documents, "Deployment")
    service = by_kind(documents, "Service")
    target = spec["scaleTargetRef"]
    assert (target["name"], target["service"]) == (deployment["metadata"]["name"],
                                                   service["metadata"]["name"])  # fmt: skip
    assert target["port"] in [port["port"] for port in service["spec"]["ports"]]

    # Replicas read the cache the Job writes, with the same settings and image.
    claim = by_kind(documents, "PersistentVolumeClaim")["metadata"]["name"]
    pod = deployment["spec"]["template"]["spec"]
    job = by_kind(documents, "Job")["spec"]["template"]["spec"]
    for spec_, writable in ((pod, False), (job, True)):
        (volume,) = [v for v in spec_["volumes"] if v["name"] == "artifacts"]
        assert volume == {"name": "artifacts", "persistentVolumeClaim": {
            "claimName": claim, **({} if writable else {"readOnly": True})}}  # fmt: skip
        (container,) = spec_["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "artifacts"]
        assert mount.get("readOnly", False) is not writable
        assert mount["mountPath"] == "/var/cache/batchserve"
    (server,), (prepare,) = pod["containers"], job["containers"]
    assert prepare["command"] == ["python", "-m", "app.export"]
    assert (prepare["image"], prepare["envFrom"]) == (server["image"], server["envFrom"])


def test_kserve_serverless_scales_to_zero_on_one_port() -> None:
    service = yaml.safe_load(
        (KUBERNETES / "kserve" / "inferenceservice-serverless.yaml").read_text()
    )
    jsonschema.validate(service, BY_KIND["InferenceService"])
    assert service["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Serverless"
    predictor = service["spec"]["predictor"]
    (container,) = predictor["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert predictor["minReplicas"] == 0
    assert predictor["scaleMetric"] == "concurrency"
    assert predictor["scaleTarget"] == 2 * int(env["BATCHSERVE_MAX_BATCH_SIZE"])
    # Knative routes one port: HTTP, and gRPC off.
    assert [port["containerPort"] for port in container["ports"]] == [8000]
    assert env["BATCHSERVE_GRPC_PORT"] == "0"
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "artifacts"]
    assert mount["readOnly"] is True


ALL_OVERLAYS = [*OVERLAYS, "scale-to-zero"]
KSERVE = ["inferenceservice.yaml", "inferenceservice-serverless.yaml"]
EXIT_MARGIN_S = 5  # the process's own exit after the lifespan


def pod_specs(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every pod template of the documents: Deployments' and Jobs', KServe predictors'."""
    pods = []
    for document in documents:
        if document["kind"] in ("Deployment", "Job"):
            pods.append(document["spec"]["template"]["spec"])
        elif document["kind"] == "InferenceService":
            pods.append(document["spec"]["predictor"])
    return pods


def references(pod: dict[str, Any]) -> set[tuple[str, str]]:
    """The (kind, name) of every claim, secret and config map a pod needs to start."""
    found = set()
    for volume in pod.get("volumes", []):
        if "persistentVolumeClaim" in volume:
            found.add(("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]))
        if "secret" in volume:
            found.add(("Secret", volume["secret"]["secretName"]))
        if "configMap" in volume:
            found.add(("ConfigMap", volume["configMap"]["name"]))
    for container in pod["containers"]:
        for source in container.get("envFrom", []):
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in source and not source[key].get("optional"):
                    found.add((kind, source[key]["name"]))
        for variable in container.get("env", []):
            for kind, key in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                ref = variable.get("valueFrom", {}).get(key)
                if ref is not None and not ref.get("optional"):
                    found.add((kind, ref["name"]))
    return found


def prerequisites() -> set[str]:
    """The names the deployment guide's Kubernetes section lists as prerequisites."""
    guide = (ROOT / "docs" / "deployment.md").read_text()
    section = guide.split("## Kubernetes", 1)[1].split("\n## ", 1)[0]
    listed = section.split("**Prerequisites**", 1)[1].split("\n\n", 2)[1]
    return {re.findall(r"`([a-z0-9.-]+)`", line)[0] for line in listed.splitlines()
            if line.startswith("- ")}  # fmt: skip


def image_graceful_shutdown_s() -> float:
    """uvicorn's ``--timeout-graceful-shutdown`` in the image's command."""
    (command,) = [line for line in (ROOT / "Dockerfile").read_text().splitlines()
                  if line.startswith("CMD ")]  # fmt: skip
    arguments = json.loads(command.removeprefix("CMD "))
    return float(arguments[arguments.index("--timeout-graceful-shutdown") + 1])


def kserve_documents() -> list[dict[str, Any]]:
    return [yaml.safe_load((KUBERNETES / "kserve" / name).read_text()) for name in KSERVE]


@pytest.mark.parametrize("target", [*ALL_OVERLAYS, "kserve"])
def test_every_layout_starts_in_an_empty_namespace(target: str) -> None:
    """Every claim, secret and config map a pod references is defined beside it or named as
    a prerequisite in the deployment guide; pretrained weights have somewhere writable to go;
    and the shutdown (preStop, then DRAIN_TIMEOUT_S from SIGTERM, then uvicorn's graceful shutdown)
    fits in the termination grace period."""
    documents = kserve_documents() if target == "kserve" else rendered(target)
    defined = {(document["kind"], document["metadata"]["name"]) for document in documents}
    listed = prerequisites()
    for pod in pod_specs(documents):
        missing = {ref for ref in references(pod) if ref not in defined and ref[1] not in listed}
        assert not missing, f"{target}: {missing} neither defined nor a listed prerequisite"
    drain = float(Settings.model_fields["drain_timeout_s"].default)
    for document in documents:
        if document["kind"] not in ("Deployment", "InferenceService"):
            continue  # a Job runs to its end: it is not drained
        (pod,) = pod_specs([document])
        (container,) = pod["containers"]
        env = {item["name"]: item.get("value") for item in container.get("env", [])}
        if document["kind"] != "InferenceService":
            env |= by_kind(documents, "ConfigMap")["data"]
        drain = float(env.get("BATCHSERVE_DRAIN_TIMEOUT_S") or drain)
        pause = 0.0
        if "lifecycle" in container:
            pause = float(container["lifecycle"]["preStop"]["exec"]["command"][1])
        budget = pause + drain + image_graceful_shutdown_s() + EXIT_MARGIN_S
        assert pod["terminationGracePeriodSeconds"] >= budget, (target, budget)
        if env.get("BATCHSERVE_WEIGHTS", "pretrained") == "pretrained":
            home = env.get("TORCH_HOME")
            assert home is not None, f"{target}: no TORCH_HOME, and the root is read-only"
            mounts = [mount for mount in container["volumeMounts"]
                      if home.startswith(mount["mountPath"] + "/")]  # fmt: skip
            assert mounts, f"{target}: TORCH_HOME {home} is on no volume"
            if not mounts[0].get("readOnly"):
                continue  # downloaded at start into a writable cache
            # Read-only: a Job of the layout fills that volume first.
            assert target in ("scale-to-zero", "kserve"), target
