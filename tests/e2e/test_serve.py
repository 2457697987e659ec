"""``cleave serve``: one command starts router + workers, serves, and stops every child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from tests.integration.cluster import ROOT, free_port


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(stat) and not stat.startswith("Z")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_answers_and_stops_all_children(checkpoint_factory, sig):
    model_dir = checkpoint_factory("llama")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "serve", "--model", str(model_dir), "--port", str(port),
         "--kv-cache-memory", "32MiB", "--dtype", "float32"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    lines = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "".join(lines[-30:])
            lines.append(line)
            if "Press Ctrl-C" in line:
                break
        assert any(f"http://127.0.0.1:{port}/v1" in ln for ln in lines)
        children = _children(proc.pid)
        assert len(children) == 3  # router, prefill worker, decode worker
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(
            model=model_dir.name, messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert out.choices[0].finish_reason in ("length", "stop")
        # Metrics are on by default: the summary names every worker's /metrics URL and the router's.
        urls = [part.split("=", 1)[1] for ln in lines for part in ln.split() if part.startswith("metrics=http")]
        urls += [ln.split()[-1] for ln in lines if "router metrics:" in ln]
        assert len(urls) == 3, "".join(lines)
        for url in urls:
            with urllib.request.urlopen(url, timeout=10) as resp:
                assert b"cleave_" in resp.read()
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(c) for c in children), "a child outlived cleave serve"
    finally:
        if proc.poll() is None:
            proc.kill()
