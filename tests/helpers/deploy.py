"""Render the Helm chart and read the compose file, for the deployment checks.

No Kubernetes API server or Docker engine runs here: the chart is rendered by a
real ``helm`` binary (``make tools`` fetches it into ``.tools/``) and checked
offline; the compose file is checked by ``docker-compose config``.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "cleave"
K8S_MANIFESTS = REPO / "deploy" / "k8s" / "cleave.yaml"
COMPOSE_FILE = REPO / "docker-compose.yml"
# Every values set in ci/ plus the defaults.
VALUES_SETS = ["default", *sorted(p.stem for p in (CHART / "ci").glob("*-values.yaml"))]
# Operator kinds, offered to `helm template` as installed CRDs (.Capabilities).
CRD_API_VERSIONS = ["monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PodMonitor"]
# How the one rendering for deploy/k8s is made (the Makefile's k8s-manifests target).
K8S_RENDER_ARGS = ["template", "cleave", str(CHART), "--namespace", "default", "--skip-tests"]


def helm_binary() -> str:
    local = REPO / ".tools" / "helm"
    found = str(local) if local.is_file() else shutil.which("helm")
    if found is None:
        pytest.skip("no helm binary: `make tools` fetches one into .tools/")
    return found


def run_helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120)


def values_args(values_set: str) -> list[str]:
    return [] if values_set == "default" else ["-f", str(CHART / "ci" / f"{values_set}.yaml")]


@functools.cache
def render(values_set: str = "default", *extra: str, crds: bool = True) -> list[dict]:
    """The chart's documents for one values set (tests included), parsed; cached, do not change them."""
    api = [a for v in CRD_API_VERSIONS for a in ("--api-versions", v)] if crds else []
    result = run_helm("template", "t", str(CHART), "--namespace", "ns", *values_args(values_set), *api, *extra)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    """(object name, pod spec) of every workload and test pod."""
    out = []
    for doc in docs:
        spec = doc.get("spec", {})
        if doc["kind"] == "Pod":
            out.append((doc["metadata"]["name"], spec))
        elif "template" in spec and "spec" in spec["template"]:
            out.append((doc["metadata"]["name"], spec["template"]["spec"]))
    return out


@functools.cache
def compose_config(*profiles: str, shell: tuple[tuple[str, str], ...] = ()) -> dict:
    """``docker-compose config`` of the compose file (every profile by default), parsed; ``shell``: (name, value) pairs
    of variables set in the calling shell."""
    profiles = profiles or ("tracing",)
    args = [a for p in profiles for a in ("--profile", p)]
    result = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE_FILE), *args, "config"],
        capture_output=True, text=True, cwd=REPO, timeout=60, env={"PATH": "/usr/bin:/bin", **dict(shell)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)
