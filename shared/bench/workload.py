"""The benchmark workload: variable prompt/output lengths, fixed seed (torch-free)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def make_workload(
    num_requests: int = 200,
    prompt_len: tuple[int, int] = (32, 512),
    output_len: tuple[int, int] = (16, 256),
    vocab_size: int = 1000,
    seed: int = 0,
    avoid_ids: frozenset[int] = frozenset(),
    long_prompt_fraction: float = 0.0,
    long_prompt_len: tuple[int, int] = (1024, 2048),
) -> list[BenchRequest]:
    """Random token prompts with lengths uniform in the given inclusive ranges."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in avoid_ids]
    out = []
    for _ in range(num_requests):
        lo, hi = long_prompt_len if rng.random() < long_prompt_fraction else prompt_len
        n = rng.randint(lo, hi)
        out.append(BenchRequest([rng.choice(allowed) for _ in range(n)], rng.randint(*output_len)))
    return out


def make_prefix_workload(
    num_requests: int,
    num_groups: int,
    prefix_len: int,
    suffix_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int = 1000,
    seed: int = 0,
    avoid_ids: frozenset[int] = frozenset(),
) -> tuple[list[BenchRequest], list[int]]:
    """Shared-prefix prompts: ``num_groups`` prefixes of ``prefix_len`` tokens, each request one group's
    prefix plus its own suffix (many users per group, as with a shared system prompt or document).

    Returns the requests and each request's group.
    """
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in avoid_ids]
    prefixes = [[rng.choice(allowed) for _ in range(prefix_len)] for _ in range(num_groups)]
    requests, groups = [], []
    for _ in range(num_requests):
        group = rng.randrange(num_groups)
        suffix = [rng.choice(allowed) for _ in range(rng.randint(*suffix_len))]
        requests.append(BenchRequest(prefixes[group] + suffix, rng.randint(*output_len)))
        groups.append(group)
    return requests, groups


def ideal_prefix_hit_blocks(requests: list[BenchRequest], groups: list[int], prefix_len: int, block_size: int) -> int:
    """Prefix-cache hits (in blocks) if every group's prefix were computed exactly once."""
    prefix_blocks = prefix_len // block_size
    return prefix_blocks * (len(requests) - len(set(groups)))
