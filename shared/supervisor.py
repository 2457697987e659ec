"""Child processes that are restarted when they exit, with backoff, until the supervisor stops.

``cleave serve`` runs every service under a ``Supervisor``: a worker or router
that dies is restarted (with the same arguments, so on the same address) after
a delay that doubles on each quick failure, up to ``MAX_BACKOFF_S``; a child
that stayed up for ``STABLE_AFTER_S`` starts again from the shortest delay.
The other children keep serving meanwhile. Only ``stop`` ends them all.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("cleave.supervisor")

MIN_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0
READY_TIMEOUT_S = 300


@dataclass
class Child:
    """One supervised service: how to start it, and its current process."""

    name: str
    module: str
    args: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = MIN_BACKOFF_S
    restart_at: float | None = None  # monotonic time of the pending restart
    info: dict[str, str] = field(default_factory=dict)  # its CLEAVE_READY fields
    cpus: frozenset[int] | None = None  # the CPUs it may run on (None: the launcher's)
    niceness: int = 0  # added to the launcher's (lower priority for positive values)
    on_exit: Callable[[], None] | None = None  # called once as each exit is noticed, before any restart


def child_setup(cpus: frozenset[int] | None = None, niceness: int = 0) -> None:
    """In the child: its own session (Ctrl-C reaches only the launcher, which stops
    children in order), SIGTERM if the launcher dies without cleaning up, its CPUs and its priority."""
    os.setsid()
    if cpus:
        os.sched_setaffinity(0, cpus)
    if niceness:
        try:
            os.nice(niceness)
        except PermissionError:  # a higher priority needs CAP_SYS_NICE: keep the launcher's
            pass
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _drain(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)


class Supervisor:
    """Starts children, restarts those that exit, stops them all on ``stop``."""

    def __init__(self, log: Callable[[str], None] | None = None) -> None:
        self.children: list[Child] = []
        self.stopping = False
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))

    def start(
        self, name: str, module: str, args: list[str], cpus: frozenset[int] | None = None, niceness: int = 0
    ) -> Child:
        child = Child(name, module, list(args), cpus=cpus, niceness=niceness)
        self.children.append(child)
        self._spawn(child)
        return child

    def _spawn(self, child: Child) -> None:
        child.proc = subprocess.Popen(
            [sys.executable, "-m", child.module, *child.args], stdout=subprocess.PIPE, text=True, bufsize=1,
            preexec_fn=lambda: child_setup(child.cpus, child.niceness),
        )  # fmt: skip
        child.started_at = time.monotonic()
        child.restart_at = None

    def wait_ready_line(self, child: Child) -> dict[str, str]:
        """Read the child's output up to its ``CLEAVE_READY`` line; then print the rest as it comes."""
        proc = child.proc
        assert proc is not None and proc.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{child.name} exited with code {proc.wait()} before becoming ready")
            if line.startswith("CLEAVE_READY"):
                self.drain(child)
                child.info = dict(part.split("=", 1) for part in line.split()[1:])
                return child.info
            print(line, end="")
        raise RuntimeError(f"{child.name} not ready after {READY_TIMEOUT_S}s")

    def drain(self, child: Child) -> None:
        assert child.proc is not None
        threading.Thread(target=_drain, args=(child.proc,), daemon=True).start()

    def pin(self, child: Child, flag: str, value: str) -> None:
        """Restart ``child`` with ``flag value`` (e.g. the port it bound, so that it returns on the same address)."""
        args = child.args
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]

    def poll(self, now: float | None = None) -> None:
        """Notice exited children and restart those whose backoff has passed."""
        now = time.monotonic() if now is None else now
        for child in self.children:
            if self.stopping or child.proc is None:
                continue
            code = child.proc.poll()
            if code is None:
                continue
            if child.restart_at is None:
                if now - child.started_at >= STABLE_AFTER_S:
                    child.backoff_s = MIN_BACKOFF_S
                child.restart_at = now + child.backoff_s
                self._log(f"child_exited name={child.name} code={code} restart_in_s={child.backoff_s:.1f}")
                child.backoff_s = min(child.backoff_s * 2, MAX_BACKOFF_S)
                if child.on_exit is not None:
                    try:
                        child.on_exit()
                    except Exception as e:  # supervision goes on whatever the hook does
                        self._log(f"child_exit_hook_failed name={child.name} error={e!r}")
            elif now >= child.restart_at:
                child.restarts += 1
                self._spawn(child)
                self.drain(child)
                self._log(f"child_restarted name={child.name} restarts={child.restarts} pid={child.proc.pid}")

    def run_until_stopped(self, interval_s: float = 0.25) -> None:
        """Supervise until a signal handler raises (KeyboardInterrupt) or ``stop`` is called."""
        while not self.stopping:
            self.poll()
            time.sleep(interval_s)

    def stop(self) -> None:
        self.stopping = True
        procs = [c.proc for c in self.children if c.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
