"""The CPU thread governor: a step gets the cores other processes leave free."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shared.engine.cpu_threads import (
    BACKLOG_REQUESTS,
    LEND_AFTER_S,
    STALLED_AFTER_S,
    YIELD_MAX_S,
    CoreShare,
    ThreadGovernor,
    other_cpu_seconds,
    other_runnable_tasks,
    own_running_threads,
    runnable_tasks,
)


class FakeMachine:
    """``others`` runnable tasks of other processes, each using ``core_each`` cores while runnable."""

    def __init__(self) -> None:
        self.others = 0
        self.core_each = 1.0
        self.now = 0.0
        self.set_calls: list[int] = []
        self._cpu = 0.0
        self._cpu_at = 0.0

    def cpu_seconds(self) -> float:
        self._cpu += self.others * self.core_each * (self.now - self._cpu_at)
        self._cpu_at = self.now
        return self._cpu

    def governor(self, max_threads: int = 2, num_cpus: int = 2) -> ThreadGovernor:
        return ThreadGovernor(max_threads, num_cpus, sample=lambda: self.others, set_threads=self.set_calls.append,
                              clock=lambda: self.now, cpu_sample=self.cpu_seconds)  # fmt: skip

    def steps(self, governor: ThreadGovernor, n: int) -> int:
        for _ in range(n):
            self.now += 0.06
            governor.before_step()
        return governor.threads


def test_gives_up_a_core_another_process_wants_and_takes_it_back():
    m = FakeMachine()
    g = m.governor()
    assert m.steps(g, 30) == 2 and m.set_calls == []
    m.others = 1  # a busy process
    assert m.steps(g, 30) == 1
    assert m.set_calls == [1]
    m.others = 0
    assert m.steps(g, 30) == 2
    assert m.set_calls == [1, 2]


def test_an_odd_sample_or_a_mostly_idle_neighbour_changes_nothing():
    m = FakeMachine()
    g = m.governor()
    m.steps(g, 30)
    m.others = 3
    m.now += 0.11
    g.before_step()  # one sample says busy
    m.others = 0
    assert m.steps(g, 30) == 2 and m.set_calls == []
    for i in range(100):  # a neighbour (a router streaming tokens) runnable in one sample of five
        m.others = 1 if i % 5 == 0 else 0
        m.now += 0.11
        g.before_step()
    assert g.threads == 2 and m.set_calls == []


def test_a_neighbour_runnable_in_every_sample_counts_only_if_it_uses_the_cpu():
    m = FakeMachine()
    g = m.governor()
    m.others, m.core_each = 1, 0.45  # a client and a router streaming tokens: queued behind the step, not busy
    assert m.steps(g, 50) == 2 and m.set_calls == []
    m.core_each = 0.8  # a busy process beside a 4-thread step on 4 cores gets four fifths of a core
    assert m.steps(g, 50) == 1 and m.set_calls == [1]
    m.core_each = 1.0  # ... and a whole one once the step is down to one thread: stays at one
    assert m.steps(g, 50) == 1 and m.set_calls == [1]


def test_without_cpu_accounting_the_runnable_count_decides():
    m = FakeMachine()
    g = ThreadGovernor(2, 2, sample=lambda: m.others, set_threads=m.set_calls.append, clock=lambda: m.now,
                       cpu_sample=lambda: None)  # fmt: skip
    m.others, m.core_each = 1, 0.1
    assert m.steps(g, 30) == 1


def test_bounds_and_samples_at_most_every_interval():
    m = FakeMachine()
    g = m.governor(max_threads=4, num_cpus=8)
    m.others = 5
    assert m.steps(g, 30) == 3  # 8 CPUs, 5 taken
    m.others = 20
    assert m.steps(g, 30) == 1  # never below one
    m.others = 0
    assert m.steps(g, 30) == 4  # never above the configured count
    calls = []
    g2 = ThreadGovernor(2, 2, sample=lambda: calls.append(1) or 0, set_threads=lambda n: None, clock=lambda: 5.0)
    for _ in range(100):
        g2.before_step()
    assert len(calls) == 1  # the clock did not move: one sample


def test_reads_this_machine():
    total = runnable_tasks()
    if total is None:  # no /proc/loadavg here
        return
    assert own_running_threads() >= 1  # the caller itself is running
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 30
        seen = 0
        while time.monotonic() < deadline and seen == 0:
            others = other_runnable_tasks()
            assert others is not None and others >= 0
            seen = others
        assert seen >= 1, "a busy child process never showed as runnable"
        before, t0 = other_cpu_seconds(), time.monotonic()
        while time.monotonic() - t0 < 0.5:
            pass
        after = other_cpu_seconds()
        if before is not None and after is not None:  # the child's half second, not this loop's
            assert 0.1 <= after - before <= 2.0, (before, after)
    finally:
        busy.kill()
        busy.wait()
    assert os.cpu_count()


def test_follows_the_processs_cpu_affinity(monkeypatch):
    """Moved onto one CPU while running (taskset, a cpuset, ``cleave serve``'s split): one thread."""
    cpus = {0, 1}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus))
    m = FakeMachine()
    g = ThreadGovernor(2, None, sample=lambda: m.others, set_threads=m.set_calls.append, clock=lambda: m.now,
                       cpu_sample=m.cpu_seconds)  # fmt: skip
    assert m.steps(g, 5) == 2
    cpus.discard(0)
    assert m.steps(g, 5) == 1 and m.set_calls == [1]


class RecordingLib:
    """Stands in for the kernels' library, recording the calls: the real calls would change this test
    process's own pool (what they do is tested in tests/unit/kernels/test_cpu_pool.py, in a child)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def pool_set_threads(self, n: int) -> None:
        self.calls.append(("threads", n))

    def pool_set_helper_cpus(self, cpus, n: int) -> None:
        self.calls.append(("helper_cpus", sorted(cpus[i] for i in range(n))))

    def pool_set_lenders(self, slots, index, n: int) -> None:
        self.calls.append(("lenders", [index[i] for i in range(n)] if n else []))


def _share_file(tmp_path, slots: int) -> str:
    path = tmp_path / "share"
    path.write_bytes(bytes(8 * slots))
    return str(path)


def test_core_share_borrows_only_once_every_lender_has_been_idle_a_while(tmp_path):
    path = _share_file(tmp_path, 2)
    now = [100.0]
    lenders = [CoreShare(f"{path}:lend:{i}", clock=lambda: now[0]) for i in (0, 1)]
    lib = RecordingLib()
    borrower = CoreShare(f"{path}:borrow:0-1:0,3", own_threads=1, lib=lib, clock=lambda: now[0])  # type: ignore[arg-type]
    assert lib.calls == [("helper_cpus", sorted({0, 3} | set(os.sched_getaffinity(0)))), ("lenders", [0, 1])]
    borrower.before_step()
    assert not borrower.borrowing  # a fresh file: no lender has said it is idle
    lenders[0].idle()
    now[0] += LEND_AFTER_S * 2
    borrower.before_step()
    assert not borrower.borrowing  # the second lender has not
    lenders[1].idle()
    borrower.before_step()
    assert not borrower.borrowing  # idle, but only just
    now[0] += LEND_AFTER_S * 1.5
    borrower.before_step()
    assert borrower.borrowing and lib.calls[-1] == ("threads", 1 + 2)
    lenders[1].before_step()  # a prefill step starts: the CPUs go back at the borrower's next step
    borrower.before_step()
    assert not borrower.borrowing and lib.calls[-1] == ("threads", 0)
    lenders[1].idle()
    lenders[1].idle()  # idle again: the time it went idle is kept, not renewed
    now[0] += LEND_AFTER_S * 0.6
    lenders[1].idle()
    now[0] += LEND_AFTER_S * 0.6
    borrower.before_step()
    assert borrower.borrowing and borrower.changes == 3


def test_core_share_lends_and_borrows_in_one_process(tmp_path):
    """Both sides of cleave serve's split: a prefill worker borrows the decode CPUs while the decode
    worker is idle, and the decode worker the prefill CPUs while the prefill worker is."""
    path = _share_file(tmp_path, 2)
    now = [100.0]
    prefill_lib, decode_lib = RecordingLib(), RecordingLib()
    prefill = CoreShare(f"{path}:lend:0:borrow:1:1", lib=prefill_lib, clock=lambda: now[0])  # type: ignore[arg-type]
    decode = CoreShare(f"{path}:lend:1:borrow:0:0", lib=decode_lib, clock=lambda: now[0])  # type: ignore[arg-type]
    assert prefill.role == decode.role == "lend+borrow"
    assert prefill_lib.calls[-1] == ("lenders", [1]) and decode_lib.calls[-1] == ("lenders", [0])
    decode.idle()
    now[0] += LEND_AFTER_S * 2
    prefill.before_step()  # a lone prompt: the prefill takes the idle decode CPU as well
    assert prefill.borrowing and prefill_lib.calls[-1] == ("threads", 2)
    decode.before_step()  # its request arrives: the prefill worker is busy, nothing to borrow
    assert not decode.borrowing and decode.busy
    prefill.before_step()
    assert not prefill.borrowing and prefill_lib.calls[-1] == ("threads", 0)
    prefill.idle()
    now[0] += LEND_AFTER_S * 2
    decode.before_step()
    assert decode.borrowing and decode_lib.calls[-1] == ("threads", 2)


def test_a_prefill_borrower_takes_the_idle_decode_cpus_for_a_lone_prompt_only(tmp_path):
    """With a queue (a burst), the hand-offs of its first prompts need the decode CPUs at once: no borrowing."""
    path = _share_file(tmp_path, 2)
    now = [100.0]
    lib = RecordingLib()
    prefill = CoreShare(f"{path}:lend:0:borrow:1:1", lib=lib, clock=lambda: now[0], borrow_max_requests=1)  # type: ignore[arg-type]
    CoreShare(f"{path}:lend:1", clock=lambda: now[0]).idle()
    now[0] += LEND_AFTER_S * 2
    prefill.before_step(num_requests=5)
    assert not prefill.borrowing
    prefill.before_step(num_requests=1)
    assert prefill.borrowing and lib.calls[-1] == ("threads", 2)
    prefill.before_step(num_requests=3)  # more arrived: the CPUs go back at once
    assert not prefill.borrowing and lib.calls[-1] == ("threads", 0)


def test_a_decode_lender_yields_its_cpus_while_the_prefill_side_has_a_queue(tmp_path):
    """cleave serve's split under a burst: the prefill worker holds a queue; the decode worker pauses
    yield_ratio times its step after each step (at most YIELD_MAX_S), and the prefill worker borrows the
    decode CPUs whenever the pool finds them idle, not after LEND_AFTER_S."""
    path = _share_file(tmp_path, 2)
    now = [100.0]
    lib = RecordingLib()
    prefill = CoreShare(f"{path}:lend:0:borrow:1:1", lib=lib, clock=lambda: now[0], borrow_max_requests=1,  # type: ignore[arg-type]
                        borrow_in_backlog=True)  # fmt: skip
    decode = CoreShare(f"{path}:lend:1:borrow:0:0", clock=lambda: now[0], yield_ratio=2.0)
    decode.before_step(num_requests=4)
    assert decode.yield_after(0.01) == 0.0  # the prefill worker has not started
    prefill.before_step(num_requests=1)  # a lone prompt: no queue
    assert decode.yield_after(0.01) == 0.0 and not prefill.borrowing  # and the decode side computes
    prefill.before_step(num_requests=BACKLOG_REQUESTS)
    assert decode.yield_after(0.01) == pytest.approx(0.02)
    assert decode.yield_after(1.0) == YIELD_MAX_S
    assert prefill.borrowing and lib.calls[-1] == ("threads", 2)  # the pool decides loop by loop
    assert not decode.borrowing
    decode.before_step(num_requests=4)
    decode.idle()  # the pause: its CPUs are lent from the prefill worker's next parallel loop on
    assert prefill.lenders_idle(0.0)
    decode.before_step(num_requests=4)  # the next step
    assert not prefill.lenders_idle(0.0)
    prefill.before_step(num_requests=1)  # the queue drained: the decode worker steps as fast as it can
    assert decode.yield_after(0.01) == 0.0 and not prefill.borrowing
    prefill.before_step(num_requests=3)
    prefill.idle()
    assert decode.yield_after(0.01) == 0.0  # an idle prefill worker has no queue
    quiet = CoreShare(f"{path}:lend:1:borrow:0:0", clock=lambda: now[0])
    prefill.before_step(num_requests=3)
    assert decode.yield_after(0.01) > 0.0 and quiet.yield_after(0.01) == 0.0  # yield_ratio 0: never


def test_a_decode_lender_yields_only_while_more_requests_wait_for_a_first_token_than_it_runs(tmp_path):
    """The decode worker pauses while the prefill side holds more requests than it decodes itself (its small
    steps cost about as much as full ones); once it runs as many, it steps without pausing, so the long
    outputs of a burst's first requests are not held back for the rest of the queue."""
    path = _share_file(tmp_path, 2)
    prefill = CoreShare(f"{path}:lend:0")
    decode = CoreShare(f"{path}:lend:1:borrow:0:0", yield_ratio=2.0)
    prefill.before_step(num_requests=40)
    assert decode.backlog() == 40
    assert decode.yield_after(0.01, num_running=1) == pytest.approx(0.02)
    assert decode.yield_after(0.01, num_running=39) == pytest.approx(0.02)
    assert decode.yield_after(0.01, num_running=40) == 0.0
    assert decode.yield_after(0.01, num_running=64) == 0.0
    prefill.before_step(num_requests=BACKLOG_REQUESTS - 1)  # no queue: never, however few it runs
    assert decode.yield_after(0.01, num_running=0) == 0.0
    prefill.idle()
    assert decode.backlog() == 0 and decode.yield_after(0.01, num_running=0) == 0.0


def test_a_decode_lender_stops_yielding_to_a_prefill_side_that_no_longer_steps(tmp_path):
    """A prefill worker stopped (SIGSTOP) or wedged with a queue leaves its slot as it was: after
    STALLED_AFTER_S without a step begun, the decode worker steps at its own pace again (it would otherwise
    decode at a fraction of its speed until the router gave up on the prefill); a step of the prefill worker,
    even with as many requests as before, makes it yield again."""
    path = _share_file(tmp_path, 2)
    now = [100.0]
    prefill = CoreShare(f"{path}:lend:0", clock=lambda: now[0])
    decode = CoreShare(f"{path}:lend:1:borrow:0:0", clock=lambda: now[0], yield_ratio=2.0)
    prefill.before_step(num_requests=8)
    assert decode.yield_after(0.01, num_running=2) == pytest.approx(0.02)
    now[0] += STALLED_AFTER_S - 0.1
    assert decode.yield_after(0.01, num_running=2) == pytest.approx(0.02)
    now[0] += 0.1
    assert decode.yield_after(0.01, num_running=2) == 0.0  # no step begun for STALLED_AFTER_S
    prefill.before_step(num_requests=8)  # the same queue, one step on
    assert decode.backlog() == 8 and decode.yield_after(0.01, num_running=2) == pytest.approx(0.02)
    prefill.before_step(num_requests=8)
    now[0] += STALLED_AFTER_S
    assert decode.yield_after(0.01, num_running=2) == pytest.approx(0.02)  # moved since the last read
    now[0] += STALLED_AFTER_S
    assert decode.yield_after(0.01, num_running=2) == 0.0


@pytest.mark.parametrize(
    "spec",
    ["{path}:lend", "{path}:share:0", "{path}:lend:5", "{path}:borrow:3:0", "{path}:lend:0:borrow:0-1:2",
     "{path}:borrow:0"],
)  # fmt: skip
def test_core_share_refuses_a_malformed_spec(tmp_path, spec):
    path = _share_file(tmp_path, 2)
    with pytest.raises(ValueError):
        CoreShare(spec.format(path=path))


def test_a_prefill_borrower_back_from_a_rest_takes_the_cpus_the_decode_side_just_freed(tmp_path):
    """One request at a time: the next prompt arrives as the decode worker finishes the last one. A prefill
    worker that rested meanwhile borrows at once; one still working through a queue waits LEND_AFTER_S."""
    path = _share_file(tmp_path, 2)
    now = [100.0]
    lib = RecordingLib()
    prefill = CoreShare(f"{path}:lend:0:borrow:1:1", lib=lib, clock=lambda: now[0], borrow_max_requests=1,  # type: ignore[arg-type]
                        lend_after_rest_s=0.0)  # fmt: skip
    decode = CoreShare(f"{path}:lend:1", clock=lambda: now[0])
    prefill.idle()  # its prompt is handed off; the request decodes
    now[0] += LEND_AFTER_S * 3
    decode.idle()  # and ends
    now[0] += LEND_AFTER_S * 0.01
    prefill.before_step(num_requests=1)  # the next prompt, right away
    assert prefill.borrowing and lib.calls[-1] == ("threads", 2)
    decode.before_step()  # its hand-off: the decode side computes again
    prefill.before_step(num_requests=3)  # and more prompts queued: a burst
    assert not prefill.borrowing
    decode.idle()  # the decode side idles while the prefill worker works through its queue: the usual wait
    now[0] += LEND_AFTER_S * 0.5
    prefill.before_step(num_requests=1)
    assert not prefill.borrowing
    now[0] += LEND_AFTER_S
    prefill.before_step(num_requests=1)
    assert prefill.borrowing
