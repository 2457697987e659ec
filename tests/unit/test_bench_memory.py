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


def test_warmup_workloads_keep_the_shape_with_other_prompts(checkpoint_factory):
    """``--warmup-rounds``: each round has the timed workload's size and length ranges, and prompts of its own
    (none begins as a timed one does, so a prefix cache warmed by them serves the timed run nothing)."""
    import argparse

    from shared.bench.throughput import warmup_workloads
    from shared.bench.workload import make_workload
    from shared.models.config import load_model_config

    model_dir = checkpoint_factory("llama")
    config = load_model_config(model_dir)
    avoid = frozenset(t for t in [*config.eos_token_ids, config.bos_token_id] if t is not None)
    args = argparse.Namespace(model=str(model_dir), num_prompts=12, prompt_len=(16, 40), output_len=(3, 9), seed=7,
                              warmup_rounds=2)  # fmt: skip
    timed = make_workload(12, (16, 40), (3, 9), config.vocab_size, 7, avoid)
    rounds = warmup_workloads(args)
    assert len(rounds) == 2
    starts = {tuple(r.prompt_token_ids[:16]) for r in timed}
    for round_ in rounds:
        assert len(round_) == 12
        assert all(16 <= len(r.prompt_token_ids) <= 40 and 3 <= r.max_tokens <= 9 for r in round_)
        assert not starts & {tuple(r.prompt_token_ids[:16]) for r in round_}
        assert all(t not in avoid for r in round_ for t in r.prompt_token_ids)
    assert rounds[0] != rounds[1]
