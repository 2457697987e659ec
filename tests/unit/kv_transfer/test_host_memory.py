"""Reading KV blocks from a process's memory (services.kv_transfer.host_memory), checked on this process
itself: process_vm_readv works on one's own PID like on a peer's (the peer-process case runs in
tests/integration/kv_transfer)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

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


def test_memory_the_process_did_not_offer_is_declined():
    """A description is honoured only as its process wrote it down: another address, a larger size, another
    live process of this user, or a proof path that is not the process's own file are refused."""
    source, other = torch.zeros(256), torch.zeros(256)
    described = host_memory.describe(source)
    assert os.path.isfile(described["proof"])
    for change in ({"address": other.data_ptr()}, {"num_bytes": 2 * described["num_bytes"]}):
        region, why_not = host_memory.open_region({**described, **change})
        assert region is None and "did not offer" in why_not
    for proof in (None, "relative.json", "/tmp/../etc/hostname", "/nonexistent/cleave-kv.json"):
        region, why_not = host_memory.open_region({**described, "proof": proof})
        assert region is None and "proof file" in why_not
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = _poll(lambda: host_memory.start_time(child.pid))
        region, why_not = host_memory.open_region({**described, "pid": child.pid, "start_time": started})
        assert region is None and f"not one of process {child.pid}" in why_not
    finally:
        child.kill()
        child.wait()


def test_a_proof_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path):
    described = host_memory.describe(torch.zeros(16))
    fifo = tmp_path / os.path.basename(described["proof"])
    os.mkfifo(fifo)
    region, why_not = host_memory.open_region({**described, "proof": str(fifo)})
    assert region is None and "not a small regular file" in why_not


def test_a_withdrawn_cache_is_no_longer_opened():
    source = torch.zeros(64)
    described = host_memory.describe(source)
    assert host_memory.open_region(described)[0] is not None
    host_memory.withdraw(described)
    assert not os.path.exists(described["proof"])
    region, why_not = host_memory.open_region(described)
    assert region is None and "no proof file" in why_not


def test_proofs_of_processes_that_are_gone_are_removed():
    """A worker killed before it could remove its proof file: the next description on this machine does."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = _poll(lambda: host_memory.start_time(child.pid))
    child.kill()
    child.wait()
    stale = os.path.join(os.path.realpath(tempfile.gettempdir()), f"cleave-kv-{child.pid}-{started}-1000.json")
    with open(stale, "w") as f:
        f.write("{}")
    live = host_memory.describe(torch.zeros(16))
    assert not os.path.exists(stale)
    assert os.path.exists(live["proof"])


def _poll(get, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while (value := get()) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return value


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_proof_of_another_user_is_refused(tmp_path):
    described = host_memory.describe(torch.zeros(16))
    copy = tmp_path / os.path.basename(described["proof"])
    with open(described["proof"]) as src:
        copy.write_text(src.read())
    os.chown(copy, 65534, 65534)
    region, why_not = host_memory.open_region({**described, "proof": str(copy)})
    assert region is None and "of this user" in why_not
    os.chown(copy, 0, 0)  # the same bytes as this user's file: accepted
    assert host_memory.open_region({**described, "proof": str(copy)})[0] is not None
