"""Start real Cleave processes (workers, router) on loopback ports for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL_ENGINE = ["--kv-cache-memory", "64MiB", "--max-num-batched-tokens", "256", "--dtype", "float32"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    info: dict[str, str] = field(default_factory=dict)

    def stop(self, sig: int = 15) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _pump(proc: Proc) -> None:
    assert proc.popen.stdout is not None
    for line in proc.popen.stdout:
        proc.lines.append(line)
        if line.startswith("CLEAVE_READY"):
            proc.info = dict(part.split("=", 1) for part in line.split()[1:])


def start_process(name: str, module: str, args: list[str]) -> Proc:
    popen = subprocess.Popen(
        [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=_env(), cwd=ROOT,
    )  # fmt: skip
    proc = Proc(name, popen)
    threading.Thread(target=_pump, args=(proc,), daemon=True).start()
    return proc


def wait_worker(proc: Proc, timeout: float = 120) -> Proc:
    deadline = time.monotonic() + timeout
    while not proc.info:
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} did not start:\n{''.join(proc.lines[-40:])}")
        time.sleep(0.05)
    return proc


def start_worker(role: str, model: Path, *extra: str) -> Proc:
    module = "services.prefill_worker" if role == "prefill" else "services.decode_worker"
    return start_process(
        role, module, ["--model", str(model), "--port", "0", "--metrics-port", "0", *SMALL_ENGINE, *extra]
    )


def start_router(
    model: Path, prefill: list[Proc], decode: list[Proc], *extra: str, timeout: float = 60
) -> tuple[Proc, str]:
    port = free_port()
    args = ["--model", str(model), "--port", str(port)]
    for p in prefill:
        args += ["--prefill-worker", p.info["grpc"]]
    for d in decode:
        args += ["--decode-worker", d.info["grpc"]]
    proc = start_process("router", "services.router", [*args, *extra])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"router did not start:\n{''.join(proc.lines[-40:])}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return proc, base
        except OSError:
            time.sleep(0.1)


def scrape(port: str | int, name: str) -> float:
    """Sum of a Prometheus metric's samples on a worker's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
