"""A real Prometheus server (the Debian ``prometheus`` binary) for tests: scrapes
the given targets every second; ``query`` evaluates PromQL over its HTTP API."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.integration.cluster import free_port


class Prometheus:
    def __init__(self, workdir: Path, jobs: dict[str, list[str]]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus is not installed; `make test` installs it (Debian package prometheus)")
        scrape_configs = [{"job_name": job, "static_configs": [{"targets": targets}]} for job, targets in jobs.items()]
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": scrape_configs}
        config_path = workdir / "prometheus.yml"
        config_path.write_text(json.dumps(config))  # JSON is YAML
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "prometheus.log", "w")
        self.popen = subprocess.Popen(
            [binary, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"prometheus exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.base + "/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("prometheus not ready")

    def wait_scraping(self, num_targets: int, timeout: float = 90) -> None:
        """Wait until every target has been scraped successfully at least twice (rates need two samples)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query("count(count_over_time(up[1m]) >= 2 and up == 1)")
            if result and int(result[0]["value"][1]) >= num_targets:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus is not scraping every target: {self.targets()}")
            time.sleep(0.2)

    def query(self, expr: str) -> list[dict]:
        """Instant query; returns the result vector (raises on a PromQL error)."""
        url = self.base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def targets(self) -> list[tuple[str, str, str]]:
        """(job, health, last error) of every scrape target, for failure messages."""
        with urllib.request.urlopen(self.base + "/api/v1/targets", timeout=10) as resp:
            active = json.loads(resp.read())["data"]["activeTargets"]
        return [(t["labels"]["job"], t["health"], t["lastError"]) for t in active]

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        self.log.close()
