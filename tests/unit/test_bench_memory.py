"""The throughput bench's memory figure for a baseline that runs in processes of its own."""

import subprocess
import sys
import time

from shared.bench.throughput import TreeMemory

MiB = 1 << 20

# A parent that holds 120 MiB and starts a child that holds 120 MiB more; both stay until the child ends.
TREE = """
import subprocess, sys
held = bytearray(120 << 20)
child = "held = bytearray(120 << 20); import time; time.sleep(1.5)"
subprocess.run([sys.executable, "-c", child], check=True)
"""


def test_tree_memory_sums_a_process_and_its_children():
    proc = subprocess.Popen([sys.executable, "-c", TREE])
    memory = TreeMemory(proc.pid, interval=0.05)
    assert proc.wait(timeout=30) == 0
    peak = memory.stop()
    assert peak >= 240 * MiB  # both buffers at once: more than either process ever held alone
    assert peak < 2048 * MiB


def test_tree_memory_of_a_process_that_is_gone_is_what_was_seen():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    memory = TreeMemory(proc.pid, interval=0.05)
    proc.wait(timeout=30)
    time.sleep(0.2)  # samples of a finished process read nothing and do not fail
    assert memory.stop() >= 0
