"""``cleave serve --cpu-split``: which CPUs the prefill and decode workers get."""

from __future__ import annotations

import os

import pytest

from shared import launcher


def _args(argv: list[str]):
    return launcher.parse_args(argv)


@pytest.fixture
def eight_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr(os.path, "exists", lambda path: False)  # no /dev/nvidiactl


def test_halves_decode_on_the_upper_half(eight_cpus):
    args, worker_args = _args(["--model", "m"])
    assert launcher.split_cpus(args, worker_args) == (frozenset({0, 1, 2, 3}), frozenset({4, 5, 6, 7}))


def test_two_cpus_one_each(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5})
    monkeypatch.setattr(os.path, "exists", lambda path: False)
    args, worker_args = _args(["--model", "m"])
    assert launcher.split_cpus(args, worker_args) == (frozenset({3}), frozenset({5}))


@pytest.mark.parametrize(
    "argv",
    [
        ["--cpu-split", "off"],
        ["--prefill-workers", "0"],  # aggregated: one pool does both
        ["--device", "cuda"],
        ["--device", "cuda:1"],
        ["--device=cuda:1"],
    ],
)
def test_off(eight_cpus, argv):
    args, worker_args = _args(["--model", "m", *argv])
    assert launcher.split_cpus(args, worker_args) is None


def test_off_on_one_cpu_or_a_gpu_machine(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    args, worker_args = _args(["--model", "m"])
    assert launcher.split_cpus(args, worker_args) is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os.path, "exists", lambda path: path == "/dev/nvidiactl")
    assert launcher.split_cpus(args, worker_args) is None
    args, worker_args = _args(["--model", "m", "--device", "cpu"])  # asked for the CPU: split anyway
    assert launcher.split_cpus(args, worker_args) is not None


def test_lending_is_on_unless_turned_off():
    assert not _args(["--model", "m"])[0].no_cpu_lending
    assert _args(["--model", "m", "--no-cpu-lending"])[0].no_cpu_lending


def test_the_lending_file_starts_busy_for_every_worker():
    """Zeros: nothing is borrowed before each worker has said it is idle."""
    from shared.engine.cpu_threads import CoreShare

    path = launcher.create_core_share_file(3)
    try:
        with open(path, "rb") as f:
            assert f.read() == bytes(24)
        assert not CoreShare(f"{path}:borrow:0-2:0").lenders_idle()
    finally:
        os.unlink(path)


def test_the_slot_of_a_worker_that_exited_reads_idle_not_its_last_queue():
    """A prefill worker killed while it held a queue: the supervisor's hook marks its slot idle, so a
    yielding decode worker stops pausing and may borrow the dead worker's CPUs (the router sends it the
    prompts meanwhile); a restarted worker marks itself busy again."""
    from shared.engine.cpu_threads import LEND_AFTER_S, CoreShare

    path = launcher.create_core_share_file(2)
    try:
        prefill = CoreShare(f"{path}:lend:0")
        decode = CoreShare(f"{path}:lend:1:borrow:0:0", yield_ratio=1.0)
        prefill.before_step(num_requests=5)
        assert decode.yield_after(0.01) > 0.0 and not decode.lenders_idle(0.0)
        launcher.release_core_share_slot(path, 0)  # what the supervisor calls when it notices the exit
        assert decode.yield_after(0.01) == 0.0 and decode.lenders_idle(0.0)
        assert not decode.lenders_idle(LEND_AFTER_S * 100)  # idle from the moment of the release
        CoreShare(f"{path}:lend:0")  # the restarted worker
        assert not decode.lenders_idle(0.0)
    finally:
        os.unlink(path)
