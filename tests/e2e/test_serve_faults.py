"""``cleave serve`` under SIGKILL: each process is killed in turn; the others keep serving,
the killed one is restarted (logged), and no stream hangs: each ends with [DONE]."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.e2e.test_serve import _children
from tests.integration.cluster import ROOT, free_port


class Serve:
    def __init__(self, model_dir, port: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", "serve", "--model", str(model_dir), "--port", str(port),
             "--kv-cache-memory", "32MiB", "--dtype", "float32", "--kv-transfer-backend", "tcp"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
        )  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for_line(self, text: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines[-40:])
            time.sleep(0.1)


def child_pid(serve: Serve, module: str) -> int:
    for pid in _children(serve.proc.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if module.encode() in f.read():
                return pid
    raise AssertionError(f"no child runs {module}")


def stream_chat(base: str, model: str) -> list[str]:
    """A streaming chat; returns its SSE data lines (it must end, with tokens or an error event)."""
    body = {"model": model, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 40,
            "stream": True}  # fmt: skip
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as resp:
            if resp.status_code != 200:
                return [f"status {resp.status_code}"]
            return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    except httpx.TransportError as e:  # the router itself was killed
        return [f"transport error {e!r}"]


def served_again(base: str, model: str, timeout_s: float = 90) -> float:
    """Seconds until a streaming chat completes with text again."""
    start = time.monotonic()
    while time.monotonic() < start + timeout_s:
        events = stream_chat(base, model)
        if events[-1:] == ["[DONE]"] and not any('"error"' in e for e in events):
            return time.monotonic() - start
        time.sleep(0.5)
    raise AssertionError(f"not serving {timeout_s} s after the kill")


@pytest.mark.slow
def test_sigkill_each_process_in_turn(checkpoint_factory):
    model_dir = checkpoint_factory("llama")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    serve = Serve(model_dir, port)
    try:
        serve.wait_for_line("Press Ctrl-C")
        figures = {}
        for module, name in (("services.decode_worker", "decode-0"), ("services.prefill_worker", "prefill-0"),
                             ("services.router", "router")):  # fmt: skip
            victim = child_pid(serve, module)
            inflight: list[list[str]] = []
            streamer = threading.Thread(target=lambda out=inflight: out.append(stream_chat(base, model_dir.name)))
            streamer.start()
            time.sleep(0.2)
            os.kill(victim, signal.SIGKILL)
            streamer.join(timeout=90)
            assert not streamer.is_alive(), f"a stream hung after {name} was killed"
            events = inflight[0]
            ended = events[-1:] == ["[DONE]"] or events[0].startswith(("status", "transport"))
            assert ended, events[-3:]
            serve.wait_for_line(f"child_restarted name={name}")
            figures[name] = round(served_again(base, model_dir.name), 1)
            assert child_pid(serve, module) != victim
            for event in events:
                if event not in ("[DONE]",) and not event.startswith(("status", "transport")):
                    json.loads(event)  # every event is valid JSON, error events included
        print(f"seconds until served again after SIGKILL: {figures}")
        assert serve.proc.poll() is None and len(_children(serve.proc.pid)) == 3
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(timeout=30) == 0
    finally:
        if serve.proc.poll() is None:
            serve.proc.kill()
