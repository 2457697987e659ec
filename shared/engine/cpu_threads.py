"""How many threads a CPU engine step uses, chosen from what else wants the CPUs.

An engine step on the CPU is hundreds of short parallel regions (one per
matrix product, attention call, norm). Each ends at a barrier where every
thread waits for the slowest. On a quiet machine the fastest way through is to
use every core and let idle threads spin briefly between regions. When another
process computes on a core without pause (another engine, a test suite), one of
the step's threads is descheduled at every barrier and the others spin or sleep
until it runs again: a 2-thread step then runs slower than a 1-thread step (2.3x
slower offline beside one busy process, measured on 2 cores).

``ThreadGovernor`` samples the number of runnable tasks on the machine
(``/proc/loadavg``) ten times a second, subtracts this process's own running
threads (``/proc/self/task``), takes the lowest count of the last second (a busy
process is runnable in every sample; a router that streams tokens only now and
then), and gives the step the cores that are left (at least one, at most the
configured count). Two processes of ``cleave serve`` that both compute thus
settle on one thread each, and either one gets both cores while the other is
idle. ``CLEAVE_CPU_THREAD_GOVERNOR=0`` keeps the thread count fixed.

Being runnable is not the same as wanting a core: a benchmark client and a
router that stream tokens beside a 2-thread step wait in the run queue
*because* the step holds both cores, and show in every sample. So a neighbour
also has to have used CPU time: the other processes' CPU seconds over the same
second (``/proc/stat`` less this process) are divided by ``NEIGHBOUR_CPU``, and
the smaller of the two counts is taken. Measured on 2 cores: the benchmark
client and the router of a 64-request burst used 0.15-0.72 of a core between
them (median 0.42), and a 1-thread step there served 5-20% fewer tokens/s than
two threads. A busy process beside an n-thread step on n cores gets n/(n+1) of
a core: it counts from 4 cores up; beside a 2-thread step (two thirds) it does
not, and costs the step 0-10% (the kernels' pool does not wait for a helper
that has no core).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable

import torch

logger = logging.getLogger("cleave.engine")

SAMPLE_INTERVAL_S = 0.1
WINDOW = 10  # samples kept: the last second
# The demand counted is the window's lowest sample: a process that computes without pause shows
# in every sample and takes a core; a router and a client that stream tokens (runnable now and
# then, even most of the time) do not, since a step at one thread less loses more than their
# short interruptions cost (measured: 2 threads serve ~10% more tokens/s beside them).


NEIGHBOUR_CPU = 0.75  # cores a neighbour uses, averaged over the window, to count as one
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc/stat units per second


def runnable_tasks() -> int | None:
    """Tasks running or ready to run on the whole machine, or None where the kernel does not say."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def own_running_threads() -> int:
    """This process's threads that are running or ready to run (at least the caller)."""
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ...: the name may hold spaces and parentheses, the state follows the last ')'.
        if stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] == "R":
            count += 1
    return max(1, count)


def other_runnable_tasks() -> int | None:
    """Runnable tasks on the machine that are not this process's threads, or None where unknown."""
    total = runnable_tasks()
    return None if total is None else max(0, total - own_running_threads())


def other_cpu_seconds() -> float | None:
    """CPU seconds the machine has spent on everything but this process since boot, or None where
    the kernel does not say."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()[1:8]  # user nice system idle iowait irq softirq
        with open("/proc/self/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields)
        own = stat[stat.rfind(")") + 2 :].split()  # from field 3 (state): utime and stime are 14 and 15
        own_ticks = int(own[11]) + int(own[12])
        return (user + nice + system + irq + softirq - own_ticks) / CLOCK_TICKS
    except (OSError, IndexError, ValueError):
        return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def enabled() -> bool:
    return os.environ.get("CLEAVE_CPU_THREAD_GOVERNOR", "1") != "0"


class ThreadGovernor:
    """Adjusts ``torch.set_num_threads`` between steps; call ``before_step`` from the engine thread."""

    def __init__(
        self,
        max_threads: int,
        num_cpus: int | None = None,
        sample: Callable[[], int | None] = other_runnable_tasks,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
        cpu_sample: Callable[[], float | None] = other_cpu_seconds,
    ) -> None:
        self.max_threads = max(1, max_threads)
        # Re-read at every sample unless given: the process may be moved (taskset, a cpuset) while it runs.
        self._cpus: Callable[[], int] = (lambda: num_cpus) if num_cpus else usable_cpus
        self.num_cpus = self._cpus()
        self._sample = sample
        self._set_threads = set_threads
        self._clock = clock
        self.threads = self.max_threads
        self._next_sample = 0.0
        self._samples: deque[int] = deque(maxlen=WINDOW)
        self._cpu_sample = cpu_sample
        self._cpu_samples: deque[tuple[float, float]] = deque(maxlen=WINDOW + 1)  # (time, other CPU s)
        self.changes = 0

    def target(self, others: int) -> int:
        """The thread count that fits beside ``others`` continuously runnable tasks of other processes."""
        return max(1, min(self.max_threads, self.num_cpus - others))

    def before_step(self) -> int:
        """Samples at most every ``SAMPLE_INTERVAL_S``; returns the thread count for this step."""
        now = self._clock()
        if self.max_threads == 1 or now < self._next_sample:
            return self.threads
        self._next_sample = now + SAMPLE_INTERVAL_S
        others = self._sample()
        if others is None:
            return self.threads
        self._samples.append(others)
        others = min(self._samples)
        cpu = self._cpu_sample()
        if cpu is None:
            self._cpu_samples.clear()
        else:
            self._cpu_samples.append((now, cpu))
            (t0, c0), (t1, c1) = self._cpu_samples[0], self._cpu_samples[-1]
            if t1 <= t0:
                return self.threads  # the first sample: no rate yet
            # What the runnable neighbours actually used: a client streaming tokens does not count.
            others = min(others, int((c1 - c0) / (t1 - t0) / NEIGHBOUR_CPU))
        self.num_cpus = self._cpus()
        wanted = self.target(others)
        if wanted != self.threads:
            logger.debug("cpu_threads threads=%d others=%d", wanted, others)
            self.threads = wanted
            self._set_threads(wanted)
            self.changes += 1
        return self.threads
