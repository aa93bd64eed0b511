"""deploy/ validated offline (issue 11): every Kubernetes object against its schema, strictly; the pieces
agree with each other and with duet's own config; a broken manifest is caught; the image build files
reference only what exists. (That the dashboards and alerts query only real series is checked against a
live scrape in tests/cluster/test_observability_queries.py.)"""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest
import yaml

from cluster.config import ClusterConfig
from tests.deploy.manifests import CRD_FILES, DEPLOY, ROOT, crd_errors, k8s_errors, load_all

KUBE = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


def objects() -> list[tuple[str, dict]]:
    return [(f.name, obj) for f in KUBE for obj in load_all(f)]


def by_kind(kind: str) -> dict:
    found = [obj for _, obj in objects() if obj["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}"
    return found[0]


def test_standard_objects_pass_kubernetes_validate_strict():
    standard = [f for f in KUBE if all((o["apiVersion"], o["kind"]) not in CRD_FILES and "coreos" not in o["apiVersion"]
                                       for o in load_all(f))]
    assert len(standard) >= 5
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", *map(str, standard)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("passed") == len(standard), out.stdout


def test_kuberay_objects_match_the_crd_schemas():
    crs = [(name, o) for name, o in objects() if (o["apiVersion"], o["kind"]) in CRD_FILES]
    assert crs, "no KubeRay object in deploy/kubernetes"
    for name, obj in crs:
        assert crd_errors(obj) == [], name


def test_the_pieces_agree():
    cluster = by_kind("RayCluster")
    config = ClusterConfig.from_dict(yaml.safe_load(by_kind("ConfigMap")["data"]["cluster.yaml"]))
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    # each pool asks for a custom resource that exactly one worker group offers, on GPU pods
    for pool in (config.prefill, config.decode):
        (resource,) = pool.resources
        offering = [n for n, g in groups.items() if resource in g["rayStartParams"].get("resources", "")]
        assert len(offering) == 1, resource
        limits = groups[offering[0]]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1"
    assert config.engine.device == "cuda" and config.autoscaler.enabled
    for role, pool in (("prefill", config.prefill), ("decode", config.decode)):  # Ray can hold duet's max
        assert groups[f"{role}-gpu"]["maxReplicas"] >= getattr(config.autoscaler, f"max_{role}") >= pool.num_workers
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    # the router Service selects the router group and exposes the ports `duet serve` listens on
    service = by_kind("Service")
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/group": "router"}
    router = groups["router"]["template"]
    ports = {p["name"]: p["containerPort"] for p in router["spec"]["containers"][0]["ports"]}
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == ports
    assert ports == {"http": config.router.port, "grpc": config.router.grpc_port}
    # probes: readiness gates traffic on /health, liveness only asks whether the process answers
    container = router["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health?probe=liveness"
    assert "duet serve --config /etc/duet/cluster.yaml --address auto" in container["args"][0]
    assert "$KUBERAY_GEN_RAY_START_CMD" in container["args"][0]
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    # the admin key comes from the Secret
    env = {e["name"]: e for e in container["env"]}
    ref = env["DUET_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
    secret = by_kind("Secret")
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    # the ServiceMonitor scrapes that Service's http port
    monitor = by_kind("ServiceMonitor")
    labels = service["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    # every volume the pods mount exists
    pvc = by_kind("PersistentVolumeClaim")["metadata"]["name"]
    for spec in [router["spec"]] + [g["template"]["spec"] for g in groups.values()]:
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] == pvc
            if "configMap" in v:
                assert v["configMap"]["name"] == by_kind("ConfigMap")["metadata"]["name"]


def _set(obj, path, value):
    *parents, leaf = path
    for key in parents:
        obj = obj[key]
    if value is _DELETE:
        del obj[leaf]
    else:
        obj[leaf] = value


_DELETE = object()
BROKEN_RAYCLUSTER = {
    "typo in a field name": (["spec", "workerGroupSpecs", 1, "replica"], 2, "replica: unknown field"),
    "wrong type": (["spec", "workerGroupSpecs", 1, "minReplicas"], "one", "is not of type 'integer'"),
    "missing required field": (["spec", "workerGroupSpecs", 1, "template", "spec", "containers"], _DELETE,
                               "'containers' is a required property"),
    "unknown field in the pod template": (["spec", "headGroupSpec", "template", "spec", "containers", 0, "imagePolicy"],
                                          "Always", "imagePolicy: unknown field"),
}


@pytest.mark.parametrize("case", list(BROKEN_RAYCLUSTER))
def test_a_broken_raycluster_fails_validation(case):
    path, value, message = BROKEN_RAYCLUSTER[case]
    broken = copy.deepcopy(by_kind("RayCluster"))
    _set(broken, path, value)
    errors = crd_errors(broken)
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize("path, value, message", [
    (["spec", "ports", 0, "port"], "eighty", "is not of type 'integer'"),
    (["spec", "prots"], [], "prots"),
])
def test_a_broken_standard_object_fails_validation(path, value, message):
    assert k8s_errors(by_kind("Service")) == []
    broken = copy.deepcopy(by_kind("Service"))
    _set(broken, path, value)
    errors = k8s_errors(broken)
    assert errors and any(message in e for e in errors), errors


def test_alert_rules_and_scrape_config_are_well_formed():
    rules = yaml.safe_load((DEPLOY / "observability" / "duet-alerts.rules.yml").read_text())
    names = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    assert {"DuetTTFTOverSLO", "DuetKVTransferFailures", "DuetPoolBelowMinimum"} <= set(names)
    assert all(r["expr"].strip() and r["labels"]["severity"] for g in rules["groups"] for r in g["rules"])
    prom = yaml.safe_load((DEPLOY / "observability" / "prometheus.yml").read_text())
    assert all((DEPLOY / "observability" / f).is_file() for f in prom["rule_files"])
    assert {j["metrics_path"] for j in prom["scrape_configs"]} == {"/metrics"}
    board = json.loads((DEPLOY / "observability" / "grafana-duet.json").read_text())
    titles = {p["title"] for p in board["panels"]}
    assert {"Time to first token", "Inter-token latency (TPOT)", "Queued requests", "KV-cache use per role",
            "Transfer bandwidth", "Workers per role: ready, target, bounds", "Autoscaler decisions (reason)"} <= titles


def test_image_build_files_reference_only_what_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z0-9_.-]+):", makefile, re.M))
    dockerfiles = sorted((DEPLOY / "docker").glob("Dockerfile.*"))
    assert {d.suffix for d in dockerfiles} == {".cpu", ".cuda"}
    for dockerfile in dockerfiles:
        text = dockerfile.read_text()
        assert re.search(r"apt-get install[^\n]*\bgcc\b", text), f"{dockerfile.name}: no C compiler for the kernels"
        for line in re.findall(r"^(?:COPY|ADD)\s+(.+)$", text, re.M):
            *sources, _dest = line.split()
            for src in sources:
                assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src} does not exist"
        for target in re.findall(r"(?:RUN|&&|;)\s*make\s+([a-z][a-z0-9-]*)", text):
            assert target in targets, f"{dockerfile.name}: make {target} is not a Makefile target"
        copied = {src.rstrip("/") for line in re.findall(r"^COPY\s+(.+)$", text, re.M) for src in line.split()[:-1]}
        packages = re.search(r"include = \[(.+?)\]", (ROOT / "pyproject.toml").read_text()).group(1)
        for package in re.findall(r'"(\w+)\*"', packages):
            assert package in copied, f"{dockerfile.name} does not copy package {package}/"
