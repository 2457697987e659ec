"""The kernels' parallel loop (``csrc/pool.c``): every item handed out exactly once, whatever the
thread count, the grain, a second caller at the same time or a fork; and the kernels built on it
give the same bits at one thread as at several."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

import pytest
import torch

from shared.kernels import cpu_kernels

lib = cpu_kernels.load()
pytestmark = pytest.mark.skipif(lib is None or not hasattr(lib, "pool_count_items"), reason="no C compiler")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def counts_of(n: int, grain: int) -> torch.Tensor:
    counts = torch.zeros(n, dtype=torch.int32)
    lib.pool_count_items(n, grain, counts.data_ptr())
    return counts


@pytest.mark.parametrize("num_threads", [1, 2, 3, 8])
@pytest.mark.parametrize("n,grain", [(1, 1), (2, 1), (7, 3), (100, 1), (1000, 4), (5000, 1), (100_000, 7)])
def test_every_item_once(threads, num_threads, n, grain):
    threads(num_threads)
    for _ in range(20):  # consecutive jobs reuse the two job slots
        assert torch.equal(counts_of(n, grain), torch.ones(n, dtype=torch.int32))


def test_nothing_for_an_empty_range(threads):
    threads(2)
    lib.pool_count_items(0, 1, None)  # would crash on the NULL counts if anything ran


def test_callers_on_several_threads_at_once(threads):
    threads(2)
    failures: list[int] = []

    def caller(seed: int) -> None:
        for i in range(200):
            n = 1 + (seed * 7919 + i * 104729) % 3000
            if not torch.equal(counts_of(n, 1 + i % 5), torch.ones(n, dtype=torch.int32)):
                failures.append(n)

    callers = [threading.Thread(target=caller, args=(s,)) for s in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert failures == []


def test_a_forked_child_runs_its_loops(threads):
    threads(2)
    assert torch.equal(counts_of(1000, 1), torch.ones(1000, dtype=torch.int32))  # helpers started here
    pid = os.fork()
    if pid == 0:  # the child has no helper threads: it must not wait for them
        ok = torch.equal(counts_of(1000, 1), torch.ones(1000, dtype=torch.int32))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(not cpu_kernels.native_linear(), reason="the native projection needs AVX-512 or AVX2 with FMA")
def test_the_projection_gives_the_same_bits_at_any_thread_count(threads):
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 384, generator=gen), torch.randn(2048, 384, generator=gen)
    threads(1)
    one = cpu_kernels.linear(x, w)
    for n in (2, 3, 4):
        threads(n)
        assert torch.equal(cpu_kernels.linear(x, w), one)


def test_decode_attention_gives_the_same_bits_at_any_thread_count(threads):
    from tests.helpers.paged import SeqChunk, build_metadata

    gen = torch.Generator().manual_seed(5)
    block_size, num_kv_heads, group, head_dim = 16, 2, 3, 64
    seq_lens = [1 + (i * 37) % 300 for i in range(40)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    ids = torch.randperm(sum(blocks_per_seq), generator=gen).tolist()
    starts = [sum(blocks_per_seq[:i]) for i in range(len(seq_lens))]
    tables = [ids[b : b + n] for b, n in zip(starts, blocks_per_seq, strict=True)]
    meta, _ = build_metadata([SeqChunk(t, s - 1, 1) for t, s in zip(tables, seq_lens, strict=True)], block_size)
    kv_cache = torch.randn(len(ids), 2, block_size, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    outs = []
    for n in (1, 2, 4):
        threads(n)
        outs.append(
            cpu_kernels.paged_decode(query, kv_cache[:, 0], kv_cache[:, 1], meta.block_tables, meta.seq_lens_cpu, 0.125)
        )
    assert outs[0] is not None
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.fixture
def pool_threads():
    yield lib.pool_set_threads
    lib.pool_set_threads(0)


def _in_child(body: Callable[[], str]) -> str:
    """What ``body`` returns, run in a forked child: the pool's settings and helpers are the child's own
    (a child's pool starts without helpers, and they take the CPUs given when they start)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without cleanup
        try:
            os.write(write, body().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return text


def _cpus_that_run_items(lent: int) -> list[int]:
    """The CPUs that ran the items of a few loops: until the helper, woken on its first loop, has taken
    items on the lent CPU, or twenty loops without it."""
    cpus = torch.full((64,), -1, dtype=torch.int32)
    seen: set[int] = set()
    for _ in range(20):
        lib.pool_record_cpus(64, 200_000, cpus.data_ptr())
        seen |= set(cpus.tolist())
        if lent in seen:
            break
    return sorted(seen)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_set_threads_overrides_the_torch_count_and_helpers_run_where_told(threads, pool_threads):
    """What a decode worker does to borrow a prefill worker's CPU: one torch thread, two pool threads,
    the caller pinned to one CPU and the helpers allowed only on the other."""
    own, lent = sorted(os.sched_getaffinity(0))[:2]

    def body() -> str:
        os.sched_setaffinity(0, {own})
        torch.set_num_threads(1)
        lib.pool_set_helper_cpus((ctypes.c_int * 1)(lent), 1)
        cpus = torch.full((64,), -1, dtype=torch.int32)
        lib.pool_record_cpus(64, 0, cpus.data_ptr())  # one thread: the caller alone
        alone = sorted(set(cpus.tolist()))
        pool_threads(2)
        return f"{alone};{_cpus_that_run_items(lent)}"

    assert _in_child(body) == f"{[own]};{[own, lent]}"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_lender_that_computes_again_has_its_cpu_back_at_the_next_loop(threads, pool_threads):
    """The pool reads the lenders' slots (cpu_threads.CoreShare's file) at every loop: while one says
    busy (0.0, or minus the requests it holds) the loops run on the caller's CPU alone, though pool_set_threads still lends; once it
    says idle again (the time it went idle) the helper on the lent CPU takes items again."""
    own, lent = sorted(os.sched_getaffinity(0))[:2]

    def body() -> str:
        os.sched_setaffinity(0, {own})
        torch.set_num_threads(1)
        lib.pool_set_helper_cpus((ctypes.c_int * 1)(lent), 1)
        slots = (ctypes.c_double * 3)(5.0, 0.0, 7.0)  # the second slot: another side's lender, busy
        lib.pool_set_lenders(ctypes.addressof(slots), (ctypes.c_int * 2)(0, 2), 2)
        pool_threads(2)
        idle = _cpus_that_run_items(lent)
        slots[2] = 0.0  # a lender starts a step
        busy = _cpus_that_run_items(lent)
        slots[2] = -3.0  # computing, with three requests (what CoreShare writes at each step)
        queued = _cpus_that_run_items(lent)
        slots[2] = 9.0
        again = _cpus_that_run_items(lent)
        lib.pool_set_lenders(None, None, 0)
        return f"{idle};{busy};{queued};{again}"

    assert _in_child(body) == f"{[own, lent]};{[own]};{[own]};{[own, lent]}"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_own_helpers_stay_off_the_lent_cpus_while_they_are_not_lent(threads, pool_threads):
    """A worker with helper threads of its own (two threads on its one CPU here) lets them onto the lent
    CPU only for loops that borrow it: a loop while the lender computes, or with nothing borrowed, runs
    where the worker's own threads run, though the helpers may run on the lent CPU."""
    own, lent = sorted(os.sched_getaffinity(0))[:2]

    def body() -> str:
        os.sched_setaffinity(0, {own})
        torch.set_num_threads(2)  # its own pool: the caller and one helper
        lib.pool_set_helper_cpus((ctypes.c_int * 2)(own, lent), 2)
        slots = (ctypes.c_double * 1)(0.0)  # the lender computes
        lib.pool_set_lenders(ctypes.addressof(slots), (ctypes.c_int * 1)(0), 1)
        pool_threads(2)
        busy = _cpus_that_run_items(lent)
        slots[0] = 9.0  # idle: lent
        borrowed = _cpus_that_run_items(lent)
        pool_threads(0)  # nothing borrowed
        own_only = _cpus_that_run_items(lent)
        lib.pool_set_lenders(None, None, 0)
        return f"{busy};{borrowed};{own_only}"

    assert _in_child(body) == f"{[own]};{[own, lent]};{[own]}"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_helper_on_a_lent_cpu_stops_taking_items_once_the_lender_computes_again(threads, pool_threads):
    """A lender's step (a decode worker back from its pause) preempts a borrower's helper on its CPU: the
    helper takes no item of the loop after the lender says busy, so the caller, which does the rest,
    waits at most for the item the helper already holds (before: for the helper's whole share)."""
    own, lent = sorted(os.sched_getaffinity(0))[:2]

    def body() -> str:
        os.sched_setaffinity(0, {own})
        torch.set_num_threads(1)
        lib.pool_set_helper_cpus((ctypes.c_int * 1)(lent), 1)
        slots = (ctypes.c_double * 1)(5.0)  # idle: lent
        lib.pool_set_lenders(ctypes.addressof(slots), (ctypes.c_int * 1)(0), 1)
        pool_threads(2)
        n, busy_at = 64, 8
        cpus, after = torch.full((n,), -1, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
        for _ in range(20):  # until the helper was at work on the lent CPU before the lender came back
            slots[0] = 5.0
            lib.pool_record_cpus_lender_back(n, 200_000, cpus.data_ptr(), ctypes.addressof(slots), busy_at,
                                             after.data_ptr())  # fmt: skip
            on_lent = [i for i in range(n) if cpus[i] == lent]
            if any(not after[i] for i in on_lent):
                break
        lib.pool_set_lenders(None, None, 0)
        before = sum(1 for i in on_lent if not after[i])
        late = sum(1 for i in on_lent if after[i])
        return f"{before > 0};{late <= 1};{sorted(set(cpus.tolist()))}"

    assert _in_child(body) == f"True;True;{[own, lent]}"
