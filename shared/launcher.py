"""``cleave serve``: router + prefill workers + decode workers as processes.

Starts the services by module name, waits until every one is healthy, prints
the URL and an example request, and stops every child on Ctrl-C or SIGTERM.
Unknown flags are passed to every worker (engine flags such as
``--kv-cache-memory``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from shared import flags
from shared.cli import DEFAULT_MODEL_DIR, env_default
from shared.models.default_model import DefaultModelError, resolve_model, served_model_name

READY_TIMEOUT_S = 300


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="cleave serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", default=env_default("--model", DEFAULT_MODEL_DIR),
                        help="Hugging Face checkpoint directory, a .gguf file, or 'demo' (random weights); "
                             "default: SmolLM2-135M-Instruct, converted on first use")  # fmt: skip
    parser.add_argument("--host", default=env_default("--host", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env_default("--port", 8000)), help="router HTTP port")
    parser.add_argument("--prefill-workers", type=int, default=int(env_default("--prefill-workers", 1)),
                        help="0 runs aggregated: decode workers do prefill too")  # fmt: skip
    parser.add_argument("--decode-workers", type=int, default=int(env_default("--decode-workers", 1)))
    parser.add_argument("--no-metrics", action="store_true",
                        help="no /metrics on the workers (by default each serves one on a free port, printed)")  # fmt: skip
    parser.add_argument("--otlp-traces-endpoint", default=env_default("--otlp-traces-endpoint", None),
                        help="OTLP/gRPC collector URL: router and workers export OpenTelemetry traces (default off)")  # fmt: skip
    parser.add_argument("--log-format", default=env_default("--log-format", "text"), choices=["text", "json"],
                        help="log lines of every process: text or one JSON object per line")  # fmt: skip
    return flags.parse_known_args(parser, argv)


class Cluster:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, module: str, args: list[str], name: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, text=True, bufsize=1,
            preexec_fn=_child_setup,
        )  # fmt: skip
        proc.name = name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def wait_ready_line(self, proc: subprocess.Popen) -> dict[str, str]:
        deadline = time.monotonic() + READY_TIMEOUT_S
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{proc.name} exited with code {proc.wait()} before becoming ready")  # type: ignore[attr-defined]
            if line.startswith("CLEAVE_READY"):
                threading.Thread(target=_drain, args=(proc,), daemon=True).start()
                return dict(part.split("=", 1) for part in line.split()[1:])
            print(line, end="")
        raise RuntimeError(f"{proc.name} not ready after {READY_TIMEOUT_S}s")  # type: ignore[attr-defined]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _child_setup() -> None:
    """In the child: its own session (Ctrl-C reaches only the launcher, which stops
    children in order), and SIGTERM if the launcher dies without cleaning up."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _drain(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="")


def wait_http_ok(url: str, proc: subprocess.Popen, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"router not healthy at {url} after {timeout_s}s")


def ensure_model(model: str) -> str:
    """The checkpoint to serve: ``demo`` and the default are created on first use; others must exist."""
    from shared.models.config import ModelLoadError
    from shared.models.gguf_file import is_gguf_path

    try:
        model = resolve_model(model)
    except (DefaultModelError, ModelLoadError) as e:
        raise SystemExit(f"error: {e}") from None
    if is_gguf_path(model):
        if not Path(model).is_file():
            raise SystemExit(f"error: {model}: GGUF file not found")
        return model
    if not (Path(model) / "config.json").exists():
        raise SystemExit(
            f"error: {model}/config.json not found; pass --model with a Hugging Face checkpoint directory, "
            "a .gguf file or 'demo'"
        )
    return model


def main(argv: list[str] | None = None) -> int:
    args, worker_args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.decode_workers < 1:
        raise SystemExit("error: --decode-workers must be >= 1")
    args.model = ensure_model(args.model)
    cluster = Cluster()
    # Both signals stop the cluster, also when started in the background (where SIGINT starts out ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        common = ["--model", args.model, "--host", args.host, "--port", "0", *worker_args]
        if args.no_metrics:
            common += ["--no-metrics"]
        shared_flags = ["--log-format", args.log_format]
        if args.otlp_traces_endpoint:
            shared_flags += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
        common += shared_flags
        pending = [
            cluster.start("services.prefill_worker", common, f"prefill-{i}") for i in range(args.prefill_workers)
        ]
        pending += [cluster.start("services.decode_worker", common, f"decode-{i}") for i in range(args.decode_workers)]
        router_args = ["--model", args.model, "--host", args.host, "--port", str(args.port),
                       "--served-model-name", served_model_name(args.model), *shared_flags]  # fmt: skip
        for proc in pending:
            info = cluster.wait_ready_line(proc)
            flag = "--prefill-worker" if info["role"] == "prefill" else "--decode-worker"
            router_args += [flag, info["grpc"]]
            metrics = "off" if info["metrics_port"] == "-1" else f"http://{args.host}:{info['metrics_port']}/metrics"
            print(f"{proc.name} ready grpc={info['grpc']} kv_backend={info['kv_backend']} "  # type: ignore[attr-defined]
                  f"metrics={metrics}", flush=True)  # fmt: skip
        router = cluster.start("services.router", router_args, "router")
        threading.Thread(target=_drain, args=(router,), daemon=True).start()
        base = f"http://{args.host}:{args.port}"
        wait_http_ok(base + "/health", router)
        print(f"\nCleave is serving {args.model} at {base}/v1\n"
              f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
              f"    -d '{{\"model\": \"{served_model_name(args.model)}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France? Answer in one sentence.\"}}], \"max_tokens\": 32}}'\n"
              f"  router metrics: {base}/metrics\n"
              "Press Ctrl-C to stop.", flush=True)  # fmt: skip
        while all(p.poll() is None for p in cluster.procs):
            time.sleep(0.5)
        dead = [p.name for p in cluster.procs if p.poll() is not None]  # type: ignore[attr-defined]
        print(f"error: {', '.join(dead)} exited; stopping the cluster", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())
