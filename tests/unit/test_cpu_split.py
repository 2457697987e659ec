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
