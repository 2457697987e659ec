"""The Helm chart: lint, render on every values set, validate every document, refuse bad values.

No Kubernetes cluster runs here. A real ``helm`` (v4) renders the chart, and every
rendered document is validated offline with ``kubernetes-validate --strict``
against the schemas of a current Kubernetes release. Operator kinds with no
schema there (ServiceMonitor, PodMonitor, ScaledObject) are skipped by name.
"""

from __future__ import annotations

import kubernetes_validate
import pytest

from tests.helpers.deploy import (
    CHART,
    K8S_MANIFESTS,
    K8S_RENDER_ARGS,
    VALUES_SETS,
    pod_specs,
    render,
    run_helm,
    values_args,
)

KUBERNETES_VERSION = "1.35.0"
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "ScaledObject"}


def _by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("values_set", VALUES_SETS)
def test_lint(values_set: str) -> None:
    result = run_helm("lint", "--strict", str(CHART), *values_args(values_set))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values_set", VALUES_SETS)
def test_every_document_validates_strictly(values_set: str) -> None:
    docs = render(values_set)
    assert len(docs) >= 10
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_values_sets_cover_the_deployments() -> None:
    assert {"default", "gpu-values", "external-redis-values", "autoscaling-values"} <= set(VALUES_SETS)


def test_default_objects() -> None:
    docs = render()
    deployments = _by_kind(docs, "Deployment")
    assert set(deployments) == {"t-cleave-router", "t-cleave-prefill", "t-cleave-decode"}
    assert set(_by_kind(docs, "StatefulSet")) == {"t-cleave-redis"}
    assert set(_by_kind(docs, "PodDisruptionBudget")) == set(deployments)
    assert {"t-cleave-workers", "t-cleave-redis"} == set(_by_kind(docs, "NetworkPolicy"))
    assert not _by_kind(docs, "HorizontalPodAutoscaler") and not _by_kind(docs, "ServiceMonitor")
    worker = deployments["t-cleave-decode"]["spec"]["template"]
    assert worker["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    (container,) = worker["spec"]["containers"]
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 600
    assert "preStop" in container["lifecycle"] and worker["spec"]["terminationGracePeriodSeconds"] >= 60
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CLEAVE_NO_PREFIX_CACHING"] == "0" and env["CLEAVE_REDIS_URL"] == "redis://t-cleave-redis:6379/0"
    assert env["CLEAVE_KV_CACHE_DTYPE"] == "auto"


def test_every_container_is_locked_down() -> None:
    for values_set in VALUES_SETS:
        for name, spec in pod_specs(render(values_set)):
            assert spec["securityContext"]["runAsNonRoot"] is True, name
            for container in spec["containers"] + spec.get("initContainers", []):
                sc = container["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"], name
                assert sc["allowPrivilegeEscalation"] is False, name


def test_gpu_values_request_the_accelerator() -> None:
    docs = render("gpu-values")
    decode = _by_kind(docs, "Deployment")["t-cleave-decode"]["spec"]
    assert decode["replicas"] == 2
    (container,) = decode["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "initContainers" not in decode["template"]["spec"]  # a real checkpoint: no demo model
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CLEAVE_NO_PREFIX_CACHING"] == "1" and env["CLEAVE_DEVICE"] == "cuda"
    assert env["CLEAVE_OTLP_TRACES_ENDPOINT"] == "http://otel-collector.observability:4317"


def test_external_redis_replaces_the_built_in_one() -> None:
    docs = render("external-redis-values")
    assert not _by_kind(docs, "StatefulSet") and "t-cleave-prefill" not in _by_kind(docs, "Deployment")
    router = _by_kind(docs, "Deployment")["t-cleave-router"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in router["env"]}
    assert env["CLEAVE_REDIS_URL"]["value"] == "redis://redis.shared.svc:6379/3"
    assert env["CLEAVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "cleave-api-key"
    assert "CLEAVE_PREFILL_WORKER" not in env
    assert _by_kind(docs, "Ingress")["t-cleave-router"]["spec"]["rules"][0]["host"] == "llm.example.org"


def _router_env(values_set: str) -> dict[str, str | None]:
    router = _by_kind(render(values_set), "Deployment")["t-cleave-router"]["spec"]["template"]["spec"]
    return {e["name"]: e.get("value") for e in router["containers"][0]["env"]}


def test_router_discovers_workers_in_redis_or_reaches_the_services_without_it() -> None:
    with_redis = _router_env("default")
    assert with_redis["CLEAVE_REDIS_URL"] == "redis://t-cleave-redis:6379/0"
    # Every worker pod registers itself: a Service address would be one more "worker" hiding several.
    assert not {"CLEAVE_PREFILL_WORKER", "CLEAVE_DECODE_WORKER", "CLEAVE_ROUTING_POLICY"} & set(with_redis)
    static = _router_env("static-values")
    assert "CLEAVE_REDIS_URL" not in static and static["CLEAVE_ROUTING_POLICY"] == "least_loaded"
    assert static["CLEAVE_PREFILL_WORKER"] == "t-cleave-prefill:50051"
    assert static["CLEAVE_DECODE_WORKER"] == "t-cleave-decode:50051"


def test_autoscaling_and_monitors_follow_the_capabilities() -> None:
    docs = render("autoscaling-values")
    (hpa,) = _by_kind(docs, "HorizontalPodAutoscaler").values()
    assert hpa["metadata"]["name"] == "t-cleave-prefill"
    assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Resource", "Pods"]
    scaled = _by_kind(docs, "ScaledObject")["t-cleave-decode"]["spec"]
    assert scaled["triggers"][0]["metadata"]["query"] == 'sum(cleave_num_requests_waiting{role="decode"})'
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (2, 10)
    assert _by_kind(docs, "ServiceMonitor") and _by_kind(docs, "PodMonitor")
    # Autoscaled pools leave replicas to the autoscaler.
    assert "replicas" not in _by_kind(docs, "Deployment")["t-cleave-decode"]["spec"]
    # Without the CRDs in the cluster's API, the chart leaves the operator objects out.
    bare = render("autoscaling-values", crds=False)
    assert not _by_kind(bare, "ServiceMonitor") and not _by_kind(bare, "PodMonitor")


def test_planner_rbac_is_the_scale_subresource_only() -> None:
    docs = render("planner-values")
    (role,) = _by_kind(docs, "Role").values()
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": ["t-cleave-prefill", "t-cleave-decode"],
            "verbs": ["get", "patch", "update"],
        }
    ]
    planner = _by_kind(docs, "Deployment")["t-cleave-planner"]["spec"]["template"]["spec"]
    assert planner["serviceAccountName"] == "t-cleave-planner"


def test_network_policy_admits_router_workers_and_prometheus_only() -> None:
    (policy,) = [d for d in render() if d["metadata"]["name"] == "t-cleave-workers"]
    rules = policy["spec"]["ingress"]
    assert rules[0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert rules[0]["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert rules[1]["from"][0]["podSelector"]["matchLabels"]["cleave.dev/worker"] == "true"
    assert rules[2]["ports"] == [{"port": "metrics", "protocol": "TCP"}] and len(rules) == 3


def test_helm_test_pod_runs_the_smoke_check() -> None:
    (pod,) = [d for d in render() if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["containers"][0]["command"] == ["python", "-m", "shared.tools.smoke"]


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("prefill.replicaz=2", "additional properties 'replicaz' not allowed"),
        ("decode.engine.blockSize=0", "minimum"),
        ("model.source=s3", "model.source"),
        ("router.service.type=Public", "router.service.type"),
        ("autoscaling.decode.kind=vpa", "kind"),
        ("decode.engine.kvCacheMemory=lots", "kvCacheMemory"),
        ("planner.enabled=true,autoscaling.decode.enabled=true", "enable one of them"),
        ("decode.engine.kvCacheDtype=fp16", "kvCacheDtype"),
        ("decode.engine.kvCacheDtype=fp8", "give both the same"),
    ],
)
def test_bad_values_are_refused(override: str, words: str) -> None:
    result = run_helm("template", "t", str(CHART), "--set", override)
    assert result.returncode != 0
    assert words.split(".")[-1] in result.stderr, result.stderr


def test_checked_in_manifests_are_fresh() -> None:
    result = run_helm(*K8S_RENDER_ARGS)
    assert result.returncode == 0, result.stderr
    assert K8S_MANIFESTS.read_text() == result.stdout, "deploy/k8s is stale: run `make k8s-manifests`"


@pytest.mark.parametrize(
    ("values_set", "words"),
    [
        ("default", "port-forward svc/t-cleave-router 8000:8000"),
        ("external-redis-values", "https://llm.example.org/v1"),
    ],
)
def test_notes_say_how_to_reach_the_endpoint(values_set: str, words: str) -> None:
    # A client-side dry run renders NOTES.txt without a cluster.
    result = run_helm("install", "t", str(CHART), "--dry-run=client", *values_args(values_set))
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert words in notes and "helm test t" in notes
