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

import ctypes
import logging
import mmap
import os
import re
import struct
import time
import weakref
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


# A borrower takes the lent CPUs only once every lender has been idle this long: between the prompts of
# a burst a prefill worker idles for moments (its next request is on its way), and a borrower's helper
# there only slowed the next prefill step (median TTFT 3-8% higher in five of six bursts without it).
LEND_AFTER_S = 0.1
# Per lender: minus the requests its engine holds while it computes, less its step count modulo 16 in 32nds
# (0.0 before its first step), else the CLOCK_MONOTONIC time it went idle. The pool (csrc/pool.c) reads "<= 0.0"
# as "computes".
SLOT = struct.Struct("d")
# A prefill side holding this many requests has a queue: the prompts of a burst wait for its CPUs, while the
# decode side steps a few sequences at a time on its own (see CoreShare.yield_after).
BACKLOG_REQUESTS = 2
# The longest pause a decode worker takes after one step for a prefill backlog, whatever its step took.
YIELD_MAX_S = 0.1
# A prefill side whose slot has not changed for this long (no step begun: stopped, wedged, or in one very long
# step) gets no more yielding: the decode side steps at its own pace until the slot moves again.
STALLED_AFTER_S = 5.0


class CoreShare:
    """CPUs lent between the processes of one box. ``cleave serve`` splits the CPUs between its prefill
    workers and its decode workers (a decode step never waits for a core a prefill holds), and a split
    leaves one side's cores idle whenever that side has nothing to do: the prefill side once a burst's
    prompts are in, the decode side while a lone prompt is prefilled. Each worker is a lender: it marks
    its slot of a small shared file busy before each step and idle, with the time, when its engine has
    no work. Each is also a borrower of the other side's CPUs: before each step it reads that side's
    slots and, once every one of them has been idle for ``LEND_AFTER_S``, lets its kernels' pool
    (``csrc/pool.c``) run helper threads on the lent CPUs too. A lender that starts again gets its CPUs
    back from the borrower's next parallel loop: the pool reads the slots at every loop
    (``pool_set_lenders``); a chunk a helper has already started finishes at the borrower's priority (a
    prefill worker runs at a lower one, so a decode step that starts while a prefill borrows keeps most
    of its core).

    ``spec`` is what ``cleave serve`` passes as ``--core-share``: ``FILE:lend:SLOT``,
    ``FILE:borrow:SLOTS:CPUS`` or both, ``FILE:lend:SLOT:borrow:SLOTS:CPUS`` (SLOTS and CPUS as in 0,2-3:
    the slots whose lenders must all be idle, and the CPUs they lend); the file holds ``SLOT.size`` zero
    bytes per lender (zero: busy, so nothing is borrowed before a lender has said it is idle)."""

    SPEC = re.compile(r"(?P<path>.+?)(?::lend:(?P<slot>\d+))?(?::borrow:(?P<slots>[\d,-]+):(?P<cpus>[\d,-]+))?")

    def __init__(
        self,
        spec: str,
        own_threads: int = 1,
        lib: ctypes.CDLL | None = None,
        clock: Callable[[], float] = time.monotonic,
        borrow_max_requests: int | None = None,
        lend_after_rest_s: float = LEND_AFTER_S,
        yield_ratio: float = 0.0,
        borrow_in_backlog: bool = False,
    ) -> None:
        from shared import flags

        match = self.SPEC.fullmatch(spec)
        if match is None or (match["slot"] is None and match["slots"] is None):
            raise ValueError(
                f"--core-share {spec!r}: expected FILE:lend:SLOT, FILE:borrow:SLOTS:CPUS or FILE:lend:SLOT:borrow:SLOTS:CPUS"
            )
        with open(match["path"], "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self.slot = int(match["slot"]) if match["slot"] is not None else -1
        if match["slots"] is not None:
            self.lender_slots = sorted(flags.parse_cpu_list(match["slots"]))
            self.lent_cpus = flags.parse_cpu_list(match["cpus"])
        else:
            self.lender_slots, self.lent_cpus = [], frozenset[int]()
        if (
            self.slot in self.lender_slots
            or not 0 <= max([self.slot, *self.lender_slots]) < len(self._map) // SLOT.size
        ):
            raise ValueError(f"--core-share {spec!r}: a slot outside the {len(self._map)}-byte file, or its own")
        self.role = "+".join(r for r, on in (("lend", self.slot >= 0), ("borrow", bool(self.lender_slots))) if on)
        self.own_threads = max(1, own_threads)
        # Borrow only while this engine holds at most this many requests (None: any number); see before_step.
        self.borrow_max_requests = borrow_max_requests
        # In a spell of work that began after this engine had itself been idle LEND_AFTER_S (a
        # request after a quiet moment, not the next of a queue), lenders idle this long already lend, until
        # the engine holds more than borrow_max_requests.
        self.lend_after_rest_s = lend_after_rest_s
        # A lender that yields: while the other side has a backlog, it pauses this many times the length of
        # its last step after each step, idle (its CPUs lent). 0: never.
        self.yield_ratio = max(0.0, yield_ratio)
        # A borrower whose own engine holds a backlog takes the lent CPUs whenever the lenders idle, from one
        # parallel loop to the next, without waiting LEND_AFTER_S (they yield to it, see yield_after).
        self.borrow_in_backlog = borrow_in_backlog
        self._rested = False  # the current spell of work began after such a rest
        self._steps = 0  # a lender's steps so far (see before_step)
        self._seen: tuple[list[float], float] = ([], 0.0)  # the lenders' slots as last read, and since when
        self.borrowing = False
        self.changes = 0
        self._clock = clock
        self.busy = self.slot >= 0
        if self.busy:  # a lender (re)starting: busy until its engine first idles, whatever a predecessor wrote
            self._mark(0.0)
        self._lib = lib if lib is not None and hasattr(lib, "pool_set_threads") else None
        if self.lender_slots and self._lib is not None:
            helper_cpus = sorted(self.lent_cpus | set(os.sched_getaffinity(0)))
            self._lib.pool_set_helper_cpus((ctypes.c_int * len(helper_cpus))(*helper_cpus), len(helper_cpus))
            # The pool reads the lenders' slots at every parallel loop: one that computes again gets its
            # CPUs back from the next loop on, not from this process's next step (a prefill step is long).
            self._slots_view = (ctypes.c_double * (len(self._map) // SLOT.size)).from_buffer(self._map)
            index = (ctypes.c_int * len(self.lender_slots))(*self.lender_slots)
            self._lib.pool_set_lenders(ctypes.addressof(self._slots_view), index, len(self.lender_slots))
            weakref.finalize(self, self._lib.pool_set_lenders, None, None, 0)  # before the file's map goes

    def _mark(self, value: float) -> None:
        """This lender's slot: 0.0 (computing) or the time it went idle."""
        SLOT.pack_into(self._map, self.slot * SLOT.size, value)

    def _idle_since(self, slot: int) -> float:
        """When the lender in ``slot`` went idle (0.0 or less while it computes: see SLOT)."""
        return SLOT.unpack_from(self._map, slot * SLOT.size)[0]

    def lenders_idle(self, after_s: float = LEND_AFTER_S) -> bool:
        now = self._clock()
        for i in self.lender_slots:
            idle_since = self._idle_since(i)
            if idle_since <= 0.0 or now - idle_since < after_s:
                return False
        return True

    def before_step(self, num_requests: int = 0) -> None:
        """``num_requests``: what the engine holds (running and waiting); above ``borrow_max_requests`` it
        does not borrow."""
        if self.slot >= 0:
            if not self.busy:
                idle_since = self._idle_since(self.slot)
                self._rested = idle_since > 0.0 and self._clock() - idle_since >= LEND_AFTER_S
                self.busy = True
            # Computing, how much it holds (see backlog), and its step count modulo 16 in 32nds: the value
            # changes at each step, which a yielding lender reads as progress (see yield_after).
            self._mark(-float(num_requests) - (self._steps % 16) / 32)
            self._steps += 1
        if not self.lender_slots:
            return
        few = self.borrow_max_requests is None or num_requests <= self.borrow_max_requests
        self._rested = self._rested and few  # a queue formed: a burst is on, not a request after a rest
        if self.borrow_in_backlog and num_requests >= BACKLOG_REQUESTS:
            borrow = True  # the pool takes the lent CPUs in the loops that find every lender idle
        else:
            borrow = few and self.lenders_idle(self.lend_after_rest_s if self._rested else LEND_AFTER_S)
        if borrow != self.borrowing:
            self.borrowing = borrow
            self.changes += 1
            if self._lib is not None:
                self._lib.pool_set_threads(self.own_threads + len(self.lent_cpus) if borrow else 0)
            logger.debug("core_share borrowing=%s cpus=%s", borrow, sorted(self.lent_cpus))

    def backlog(self, slots: list[float] | None = None) -> int:
        """The most requests a lender of this process's borrowed CPUs (the other side) holds while it computes:
        its queue; 0 while none computes (a slot's fraction counts its steps, see before_step). ``slots``: the
        lenders' slots as just read (read here if None)."""
        if slots is None:
            slots = [self._idle_since(i) for i in self.lender_slots]
        return max([0, *(int(-value) for value in slots)])

    def yield_after(self, step_s: float, num_running: int = 0) -> float:
        """How long a yielding lender pauses, idle, after a step of ``step_s``: ``yield_ratio`` times it (at most
        YIELD_MAX_S) while the other side holds a queue (BACKLOG_REQUESTS or more) of more requests than this
        engine runs (``num_running``); else 0. On a box split between a prefill and a decode worker, a burst's
        prompts otherwise wait for the prefill worker's CPUs alone while the decode worker steps its first
        few sequences as fast as its own CPUs allow, each small step costing about as much as a full one
        (it reads every weight). Once the decode side runs as many requests as wait for their first token,
        it steps without pausing: its long outputs are not held back for the rest of the queue."""
        if self.yield_ratio <= 0.0 or self.slot < 0:
            return 0.0
        slots = [self._idle_since(i) for i in self.lender_slots]
        backlog = self.backlog(slots)
        if backlog < BACKLOG_REQUESTS or backlog <= num_running:
            return 0.0
        now = self._clock()
        if slots != self._seen[0]:
            self._seen = (slots, now)
        elif now - self._seen[1] >= STALLED_AFTER_S:
            return 0.0  # the other side has not stepped for that long: stopped or wedged, nothing to lend to
        return min(self.yield_ratio * step_s, YIELD_MAX_S)

    def idle(self) -> None:
        """The engine has no work: a lender's CPUs may be borrowed from ``LEND_AFTER_S`` on."""
        if self.slot >= 0 and self.busy:
            self.busy = False
            self._mark(self._clock())
