"""Reading KV blocks from a process's memory (services.kv_transfer.host_memory), checked on this process
itself: process_vm_readv works on one's own PID like on a peer's (the peer-process case runs in
tests/integration/kv_transfer)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from services.kv_transfer import host_memory

pytestmark = pytest.mark.skipif(host_memory.describe(torch.zeros(1)) is None, reason="no process_vm_readv here")


def test_a_description_opens_and_reads_exact_bytes():
    source = torch.arange(4096, dtype=torch.float32)
    region, why_not = host_memory.open_region(host_memory.describe(source))
    assert region is not None, why_not
    assert region.pid == os.getpid() and region.num_bytes == 4096 * 4
    target = torch.zeros(4096, dtype=torch.float32)
    host_memory.read(
        region, [(target.data_ptr() + 400, source.data_ptr() + 800, 64), (target.data_ptr(), source.data_ptr(), 16)]
    )
    assert target[:4].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert target[100:116].tolist() == list(range(200, 216))
    assert not target[4:100].any() and not target[116:].any()


def test_bytes_outside_the_described_cache_are_refused():
    source = torch.ones(256, dtype=torch.float32)
    region, _ = host_memory.open_region(host_memory.describe(source))
    assert region is not None
    target = torch.zeros(512, dtype=torch.float32)
    with pytest.raises(host_memory.ReadFailed, match="outside"):
        host_memory.read(region, [(target.data_ptr(), source.data_ptr() + 512, 1024)])
    assert not target.any()


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"boot_id": "another-boot"}, "another machine"),
        ({"pid_namespace": "0:0"}, "another PID namespace"),
        ({"start_time": -1}, "is not the peer"),
        ({"pid": None}, "malformed"),
    ],
)
def test_a_description_that_does_not_match_is_declined(change, reason):
    described = {**host_memory.describe(torch.zeros(16)), **change}
    region, why_not = host_memory.open_region(described)
    assert region is None and reason in why_not


def test_a_process_that_is_gone_is_not_a_peer():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    started = host_memory.start_time(child.pid)
    child.wait()
    assert host_memory.start_time(child.pid) is None
    assert started is None or started > 0
    assert host_memory.start_time(os.getpid()) == host_memory.describe(torch.zeros(1))["start_time"]


def test_only_contiguous_host_memory_is_described():
    assert host_memory.describe(torch.zeros(4, 4).t()) is None
