"""The compose stack and the image, checked without a Docker engine (none runs here).

``docker-compose config`` (Debian's docker-compose) validates and resolves the
compose file; ``promtool`` checks the Prometheus config it mounts; the
Dockerfile is read for the properties the deployment relies on, and the CPU
kernel is built with the Dockerfile's own compiler line and loaded the way the
image loads it (no compiler on the PATH).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.helpers.deploy import REPO, compose_config

WORKERS = ("prefill", "decode")


def test_every_service_has_a_healthcheck_and_conditional_dependencies() -> None:
    services = compose_config()["services"]
    assert {"redis", "demo-model", "router", "prefill", "decode", "prometheus", "grafana", "otel-collector",
            "jaeger"} == set(services)  # fmt: skip
    for name, service in services.items():
        if name != "demo-model":  # the one-shot writer exits; its success is the condition
            assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for dependency, spec in (service.get("depends_on") or {}).items():
            assert spec.get("condition") in ("service_healthy", "service_completed_successfully", "service_started"), (
                f"{name} -> {dependency}"
            )
    for worker in WORKERS:
        deps = services[worker]["depends_on"]
        assert deps["demo-model"]["condition"] == "service_completed_successfully"
        assert deps["redis"]["condition"] == "service_healthy"


def test_tracing_is_behind_a_profile_and_workers_scale() -> None:
    plain = compose_config()["services"]
    behind = {name for name, service in plain.items() if service.get("profiles")}
    assert behind == {"jaeger", "otel-collector"}
    assert all(plain[name]["profiles"] == ["tracing"] for name in behind)
    for worker in WORKERS:
        service = plain[worker]
        assert "container_name" not in service and "ports" not in service, f"{worker} cannot --scale"
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"]


def test_prometheus_finds_workers_through_docker_dns() -> None:
    config_path = REPO / "deploy" / "compose" / "prometheus.yml"
    result = subprocess.run(["promtool", "check", "config", str(config_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = {job["job_name"]: job for job in yaml.safe_load(config_path.read_text())["scrape_configs"]}
    for worker in WORKERS:
        (sd,) = jobs[f"cleave-{worker}"]["dns_sd_configs"]
        assert sd["names"] == [worker] and sd["port"] == 9090
    mounts = compose_config()["services"]["prometheus"]["volumes"]
    assert any(str(config_path) in str(m) for m in mounts)


def test_grafana_is_provisioned_from_deploy_grafana() -> None:
    volumes = compose_config()["services"]["grafana"]["volumes"]
    sources = {os.path.relpath(str(v["source"] if isinstance(v, dict) else v.split(":")[0]), REPO) for v in volumes}
    assert sources == {"deploy/grafana/provisioning", "deploy/grafana/dashboards"}


def _dockerfile() -> str:
    return (REPO / "Dockerfile").read_text()


def test_dockerfile_is_multi_stage_non_root_and_compiler_free_at_run_time() -> None:
    text = _dockerfile()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert len(stages) == 2 and stages[0].split()[2] == "build"
    runtime = stages[-1]
    assert "gcc" not in runtime.replace("CLEAVE_CPU_KERNEL_LIB", "") and "COPY --from=build /opt/cleave" in runtime
    assert re.search(r"^USER 10001", runtime, flags=re.M)
    assert 'ENTRYPOINT ["cleave"]' in runtime
    assert re.search(r"^ARG FLAVOR=cpu$", text, flags=re.M) and '"$FLAVOR" = cuda' in text
    ignored = [ln for ln in (REPO / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert ignored[0] == "*" and {"!shared/", "!services/", "!pyproject.toml"} <= set(ignored)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc to build the kernel as the image does")
def test_kernel_built_like_the_image_loads_without_a_compiler(tmp_path) -> None:
    text = _dockerfile()
    march = re.search(r"^ARG CPU_KERNEL_MARCH=(\S+)", text, flags=re.M).group(1)
    (line,) = [ln.strip() for ln in text.splitlines() if "-m shared.kernels.cpu_kernels" in ln]
    argv = shlex.split(line.removeprefix("&& ").replace("${CPU_KERNEL_MARCH}", march))
    flags_ok = march != "x86-64-v3" or "avx2" in open("/proc/cpuinfo").read()
    if not flags_ok:
        argv[argv.index("--march") + 1] = "native"
    library = tmp_path / "cpu_kernels.so"
    argv[0], argv[argv.index("/opt/cleave/lib/cpu_kernels.so")] = sys.executable, str(library)
    subprocess.run(argv, check=True, cwd=REPO, capture_output=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    probe = (
        "import shutil, torch; from shared.kernels import cpu_kernels;"
        "assert shutil.which('cc') is None and shutil.which('gcc') is None;"
        "tiny = torch.tensor([1e-39]); ok = cpu_kernels.load() is not None;"
        "assert (tiny * 1.0).item() != 0.0, 'loading the kernel turned on flush-to-zero';"
        "print(ok)"
    )
    env = {**os.environ, "CLEAVE_CPU_KERNEL_LIB": str(library), "PATH": os.path.dirname(sys.executable),
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}  # fmt: skip
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr
