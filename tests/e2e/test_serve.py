"""``cleave serve``: one command starts router + workers, serves, and stops every child."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from shared.flags import format_cpu_list
from shared.launcher import PREFILL_NICENESS, ROUTER_NICENESS
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


def _assert_registered(lines: list[str], count: int) -> None:
    """Both workers are in the Redis registry that ``cleave serve --redis`` started."""
    from services.common.registry import connect, read_registry

    url = next(ln.split("url=")[1].strip() for ln in lines if ln.startswith("redis ready"))

    async def read() -> int:
        client = connect(url)
        deadline = time.monotonic() + 30
        while len(entries := await read_registry(client)) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await client.aclose()
        return len(entries)

    assert asyncio.run(read()) == count


def _assert_cpu_split(children: list[int]) -> None:
    """By default (no GPU, at least 2 CPUs) the decode worker runs on the upper half of the CPUs and the
    prefill worker on the lower half, where it yields to the router; the router may run on any CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or os.path.exists("/dev/nvidiactl"):
        return
    half = len(cpus) // 2
    expected = {"services.decode_worker": set(cpus[half:]), "services.prefill_worker": set(cpus[:half]),
                "services.router": set(cpus)}  # fmt: skip
    seen = set()
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode()
        for module, want in expected.items():
            if f"-m {module} " in cmdline:
                assert os.sched_getaffinity(pid) == want, (module, os.sched_getaffinity(pid))
                niceness = os.getpriority(os.PRIO_PROCESS, pid) - os.getpriority(os.PRIO_PROCESS, 0)
                base = os.getpriority(os.PRIO_PROCESS, 0)
                want = {"services.prefill_worker": PREFILL_NICENESS, "services.router": ROUTER_NICENESS}.get(module, 0)
                allowed = {max(min(want, 19 - base), -20 - base)}
                if want < 0 and os.geteuid() != 0:
                    allowed.add(0)  # without CAP_SYS_NICE the router keeps the launcher's priority
                assert niceness in allowed, (module, niceness)
                # Each worker lends its CPUs (its slot) and borrows the other side's while that side idles.
                if module == "services.prefill_worker":
                    assert f":lend:0:borrow:1:{format_cpu_list(frozenset(cpus[half:]))} " in cmdline, cmdline
                elif module == "services.decode_worker":
                    assert f":lend:1:borrow:0:{format_cpu_list(frozenset(cpus[:half]))} " in cmdline, cmdline
                seen.add(module)
    assert seen == set(expected)


def _assert_bench_reports_hits(port: int, worker_urls: list[str], capsys) -> None:
    """``cleave bench serve`` counts the prompt tokens a run got from the workers' prefix caches, and warns when
    independent prompts hit (a seed run before against the same server)."""
    from shared.bench.serve import main as bench_serve

    argv = ["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "3", "--prompt-len", "40", "48",
            "--output-len", "2", "2", "--long-prompt-fraction", "0", "--vocab-size", "500", "--seed", "5",
            *(arg for url in worker_urls for arg in ("--worker-metrics", url))]  # fmt: skip
    reports = []
    for _ in range(2):
        assert bench_serve(argv) == 0
        out, err = capsys.readouterr()
        reports.append((json.loads(out), err))
    (first, first_err), (second, second_err) = reports
    assert first["prefix_cache_hit_tokens"] == 0 and "prefix cache" not in first_err
    # The same prompts again: their full blocks (two of 16 tokens each, at least) come from the cache.
    assert second["prefix_cache_hit_tokens"] >= 3 * 32, second
    assert "from its prefix cache" in second_err and "--seed" in second_err


@pytest.mark.parametrize("sig,redis", [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGTERM, True)])
def test_serve_answers_and_stops_all_children(checkpoint_factory, sig, redis, capsys):
    if redis and shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make test installs it)")
    model_dir = checkpoint_factory("llama")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "serve", "--model", str(model_dir), "--port", str(port),
         "--kv-cache-memory", "32MiB", "--dtype", "float32", *(["--redis"] if redis else [])],
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
        assert len(children) == 3 + redis  # router, prefill worker, decode worker (, redis-server)
        if redis:
            _assert_registered(lines, 2)
        _assert_cpu_split(children)
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
        if sig == signal.SIGTERM and not redis:
            _assert_bench_reports_hits(port, urls[:2], capsys)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(c) for c in children), "a child outlived cleave serve"
    finally:
        if proc.poll() is None:
            proc.kill()
