"""``cleave serve``: router + prefill workers + decode workers as processes.

Starts the services by module name, waits until every one is healthy, prints
the URL and an example request. A service that exits is restarted with backoff
on the same address while the others keep serving; only Ctrl-C or SIGTERM stops
every child.
Unknown flags are passed to every worker (engine flags such as
``--kv-cache-memory``).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from shared import flags
from shared.cli import DEFAULT_MODEL_DIR, add_engine_args, env_default
from shared.models.default_model import DefaultModelError, resolve_model, served_model_name
from shared.supervisor import READY_TIMEOUT_S, Supervisor, child_setup


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
    parser.add_argument("--cpu-split", default=env_default("--cpu-split", "auto"), choices=["auto", "off"],
                        help="auto: on a machine without a GPU, the decode workers run on the upper half of the "
                             "CPUs and the prefill workers on the rest, so that a decode step never waits for a core "
                             "a prefill holds (steadier inter-token latency, more tokens/s on 2 cores); the router "
                             "may run on any CPU; off: every process may run anywhere")  # fmt: skip
    parser.add_argument("--no-cpu-lending", action="store_true",
                        default=env_default("--no-cpu-lending", "").lower() in ("1", "true"),
                        help="under the CPU split, keep each side off the other's CPUs also while that side "
                             "is idle (by default the decode workers' kernels borrow the prefill CPUs while no "
                             "prefill worker computes, and the prefill workers' the decode CPUs while no request "
                             "decodes; a side that starts again has its CPUs back within microseconds). The worker "
                             "flag --decode-yield RATIO also lends the decode CPUs while a prefill worker has a "
                             "queue (see cleave decode-worker --help)")  # fmt: skip
    parser.add_argument("--redis", action="store_true",
                        help="also start a local redis-server; workers register in it and the router discovers them")  # fmt: skip
    return flags.parse_known_args(parser, argv)


# A prefill worker's niceness under the CPU split. A prefill step computes for tens of milliseconds
# without pause; at the same priority the router's event loop, woken for each token, sometimes
# waited behind it. Bursts of 64 on 2 cores, alternating (nice 0 / 10): the hand-off's median ITL
# 88-97 / 68-90 ms, p99 ITL 66-85 / 58-90 ms, throughput and TTFT within noise.
PREFILL_NICENESS = 10
# The router's under the split, where the system allows it (CAP_SYS_NICE; else it keeps the launcher's): it
# forwards every token of every stream, and on a loaded box it otherwise waits for a time slice behind any
# process at the default priority (a benchmark client, a sidecar) before it reads a worker's tokens. Two runs
# of eight interleaved bursts of 64 on 2 cores (bfloat16 checkpoint, the client on the same machine): output
# tok/s +5% and +9%, median TTFT -9% and -11%, p99 ITL lower in five and seven of eight.
# It runs on every CPU, not on the prefill workers' alone: pinned there, its event loop sometimes went without
# a core for 0.1-0.26 s as a burst arrived (measured from inside: the loop's thread on a CPU for 7-20 ms of
# it), while the decode CPUs idled, and every request waited, its first tokens and hand-offs included. Two
# clusters, eight alternating bursts of 64 each, pinned / on every CPU: float32 output tok/s higher in seven
# (+14%), median TTFT lower in six, p99 ITL lower in six; bfloat16 output tok/s and median TTFT better in
# six, p99 ITL in four, the p99 of the gap after the hand-off 47-85 ms against 55-252.
ROUTER_NICENESS = -5


def split_cpus(args: argparse.Namespace, worker_args: list[str]) -> tuple[frozenset[int], frozenset[int]] | None:
    """(prefill workers, decode workers) CPU sets, or None where every process shares all CPUs:
    --cpu-split off, aggregated serving (no prefill workers), fewer than 2 CPUs, or workers on a GPU."""
    if args.cpu_split == "off" or args.prefill_workers == 0:
        return None
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)  # the workers' own reading of --device (either spelling, or its variable)
    device = flags.parse_known_args(engine, worker_args)[0].device
    if device.startswith("cuda") or (device == "auto" and os.path.exists("/dev/nvidiactl")):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return frozenset(cpus[:half]), frozenset(cpus[half:])


def create_core_share_file(slots: int) -> str:
    """A zeroed file of eight bytes per worker for ``--core-share`` (shared.engine.cpu_threads.CoreShare),
    in /dev/shm where there is one (memory, not disk); the caller removes it."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="cleave-core-share-", dir=directory)
    with os.fdopen(fd, "wb") as f:
        f.write(bytes(8 * max(1, slots)))
    return path


def release_core_share_slot(path: str, slot: int) -> None:
    """Mark the slot of a worker that exited idle from now (the float64 time.monotonic() value a lender
    writes as it goes idle, see shared.engine.cpu_threads.CoreShare); the supervisor calls it as it notices
    the exit. Left as the dead process wrote it, a prefill worker's queue (minus its count) would keep the
    decode side yielding, and the dead worker's CPUs unlent, until a restarted worker marks the slot again
    (after a backoff of up to 30 s for one that keeps failing); meanwhile the router sends its prompts to
    the decode workers, which borrow those idle CPUs like any others. A restarted worker starts busy."""
    with open(path, "r+b") as f:
        f.seek(8 * slot)
        f.write(struct.pack("d", time.monotonic()))


def start_redis(host: str) -> tuple[subprocess.Popen, str]:
    """A local redis-server child on a free port (no persistence); returns it and its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("--redis needs redis-server on PATH (Debian: apt-get install redis-server)")
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    cmd = [binary, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, preexec_fn=child_setup)
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return proc, f"redis://{host}:{port}/0"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start on {host}:{port}") from None
            time.sleep(0.05)


def stop_redis(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_http_ok(url: str, proc: subprocess.Popen | None, timeout_s: float = READY_TIMEOUT_S) -> None:
    assert proc is not None
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
    cluster = Supervisor()
    redis_proc: subprocess.Popen | None = None
    share_file = ""  # the CPU-lending file (see below), removed at exit
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
        redis_args: list[str] = []
        if args.redis:
            redis_proc, redis_url = start_redis(args.host)
            redis_args = ["--redis-url", redis_url]
            common += redis_args
            print(f"redis ready url={redis_url}", flush=True)
        split = split_cpus(args, worker_args)
        prefill_cpus, decode_cpus = split or (None, None)
        if split is not None:
            print(
                f"cpus prefill={flags.format_cpu_list(split[0])} "
                f"decode={flags.format_cpu_list(split[1])} router=any (--cpu-split off to share them all)",
                flush=True,
            )
        # Under the split the router (on any CPU) also runs on the prefill workers' CPUs; it forwards every
        # token of every stream, and they yield to it (see PREFILL_NICENESS).
        niceness = PREFILL_NICENESS if split is not None else 0
        # While one side has no work, the other side's kernels borrow its CPUs: the decode workers the prefill
        # CPUs once a burst's prompts are in, the prefill workers the decode CPUs while no request decodes
        # (shared.engine.cpu_threads.CoreShare). Slots: the prefill workers', then the decode workers'.
        num_prefill, num_decode = args.prefill_workers, args.decode_workers
        lend = split is not None and not args.no_cpu_lending and num_prefill > 0 and num_decode > 0
        prefill_list = flags.format_cpu_list(prefill_cpus or frozenset())
        decode_list = flags.format_cpu_list(decode_cpus or frozenset())
        if lend:
            share_file = create_core_share_file(num_prefill + num_decode)
            print(f"cpu lending: decode workers borrow cpus {prefill_list} while no prefill worker computes, "
                  f"prefill workers cpus {decode_list} while no decode worker does "
                  "(--no-cpu-lending to keep them apart)", flush=True)  # fmt: skip

        def share(slot: int) -> list[str]:
            """A worker's --core-share: prefill workers hold slots [0, P), decode workers [P, P + D)."""
            if not lend:
                return []
            prefill = slot < num_prefill
            lenders = range(num_prefill, num_prefill + num_decode) if prefill else range(num_prefill)
            cpus = decode_list if prefill else prefill_list
            return [
                "--core-share",
                f"{share_file}:lend:{slot}:borrow:{flags.format_cpu_list(frozenset(lenders))}:{cpus}",
            ]

        pending = [cluster.start(f"prefill-{i}", "services.prefill_worker", [*common, *share(i)], prefill_cpus,
                                 niceness) for i in range(num_prefill)]  # fmt: skip
        pending += [cluster.start(f"decode-{i}", "services.decode_worker", [*common, *share(num_prefill + i)],
                                  decode_cpus) for i in range(num_decode)]  # fmt: skip
        if lend:  # a worker that dies leaves its slot idle, not as it last wrote it (e.g. a queue)
            for slot, child in enumerate(pending):
                child.on_exit = functools.partial(release_core_share_slot, share_file, slot)
        router_args = ["--model", args.model, "--host", args.host, "--port", str(args.port),
                       "--served-model-name", served_model_name(args.model), *shared_flags, *redis_args]  # fmt: skip
        for child in pending:
            info = cluster.wait_ready_line(child)
            flag = "--prefill-worker" if info["role"] == "prefill" else "--decode-worker"
            router_args += [flag, info["grpc"]]
            # A restart comes back on the same address (and metrics port), which the router knows.
            cluster.pin(child, "--port", info["grpc"].rsplit(":", 1)[1])
            if int(info["metrics_port"]) > 0:
                cluster.pin(child, "--metrics-port", info["metrics_port"])
            metrics = "off" if info["metrics_port"] == "-1" else f"http://{args.host}:{info['metrics_port']}/metrics"
            print(f"{child.name} ready grpc={info['grpc']} kv_backend={info['kv_backend']} "
                  f"metrics={metrics}", flush=True)  # fmt: skip
        router = cluster.start(
            "router", "services.router", router_args, None, ROUTER_NICENESS if split is not None else 0
        )
        cluster.drain(router)
        base = f"http://{args.host}:{args.port}"
        wait_http_ok(base + "/health", router.proc)
        if split is not None and router.proc is not None:
            raised = os.getpriority(os.PRIO_PROCESS, router.proc.pid) < os.getpriority(os.PRIO_PROCESS, 0)
            print(f"router niceness {ROUTER_NICENESS}" if raised else
                  "router at the launcher's priority (raising it needs CAP_SYS_NICE)", flush=True)  # fmt: skip
        print(f"\nCleave is serving {args.model} at {base}/v1\n"
              f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
              f"    -d '{{\"model\": \"{served_model_name(args.model)}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France? Answer in one sentence.\"}}], \"max_tokens\": 32}}'\n"
              f"  router metrics: {base}/metrics\n"
              "Press Ctrl-C to stop.", flush=True)  # fmt: skip
        cluster.run_until_stopped()
        return 0
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        stop_redis(redis_proc)  # last, so that stopping workers can still deregister
        if share_file:
            Path(share_file).unlink(missing_ok=True)


if __name__ == "__main__":
    raise SystemExit(main())
