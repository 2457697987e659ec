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
