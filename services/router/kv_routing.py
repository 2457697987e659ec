"""Cache- and load-aware choice of workers (``--routing-policy kv_aware``).

For a prompt of ``num_blocks`` full blocks and a candidate worker holding its
first ``overlap`` blocks (per the ``KVIndex``)::

    cost = overlap_weight * (num_blocks - overlap) + in_flight_blocks + num_waiting

``in_flight_blocks`` is the work this router has sent the worker and not yet
seen finish: the blocks each call makes it compute (or pull, on a decode
worker), i.e. the prompt's blocks it lacked when the call was routed. A call
on blocks the worker already caches adds nothing there: counting all its
blocks would make one running request on the holder of a shared prefix look as
costly as recomputing that prefix elsewhere, and spread every prefix over every
worker. The cheapest worker wins; with ``temperature > 0`` the choice is a
softmax over costs normalised to [0, 1], which spreads load among near-equals.
Ties rotate (the pool passes candidates in rotated order).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.router.discovery import RegistryWatcher
from services.router.kv_index import KVIndex
from services.router.workers import WorkerClient
from shared.engine.prefix_hash import block_hashes

Chooser = Callable[[Sequence[WorkerClient]], WorkerClient]


@dataclass(frozen=True)
class PromptBlocks:
    """A prompt's chained block hashes with the parameters the workers hash with."""

    hashes: list[bytes]
    block_size: int

    def uncached_tokens(self, num_prompt_tokens: int, overlap: int) -> int:
        return num_prompt_tokens - overlap * self.block_size


@dataclass
class KVRouter:
    index: KVIndex
    watcher: RegistryWatcher
    overlap_weight: float = 1.0
    temperature: float = 0.0
    min_uncached_tokens: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def prompt_blocks(self, prompt_ids: Sequence[int]) -> PromptBlocks | None:
        """Hashes computed with the block size and seed the registry reports; None before any worker is known."""
        entry = next((e for e in self.watcher.entries.values() if e.kv_events), None)
        if entry is None:
            return None
        extra = bytes.fromhex(entry.hash_seed)
        return PromptBlocks(block_hashes(prompt_ids, entry.block_size, extra=extra), entry.block_size)

    def overlap(self, worker: WorkerClient, blocks: PromptBlocks) -> int:
        if worker.entry is None:
            return 0
        return self.index.prefix_overlap(blocks.hashes).get(worker.entry.worker_id, 0)

    def uncached_blocks(self, worker: WorkerClient, blocks: PromptBlocks) -> int:
        """The prompt's blocks ``worker`` would compute or pull: what a call adds to its ``in_flight_blocks``."""
        return len(blocks.hashes) - self.overlap(worker, blocks)

    def chooser(self, blocks: PromptBlocks) -> Chooser:
        overlaps = self.index.prefix_overlap(blocks.hashes)
        num_blocks = len(blocks.hashes)

        def cost(worker: WorkerClient) -> float:
            held = overlaps.get(worker.entry.worker_id, 0) if worker.entry is not None else 0
            waiting = worker.load.num_waiting if worker.load else 0
            return self.overlap_weight * (num_blocks - held) + worker.in_flight_blocks + waiting

        def choose(candidates: Sequence[WorkerClient]) -> WorkerClient:
            return pick_by_cost(candidates, [cost(w) for w in candidates], self.temperature, self.rng)

        return choose


def pick_by_cost(
    candidates: Sequence[WorkerClient], costs: Sequence[float], temperature: float, rng: random.Random
) -> WorkerClient:
    """The cheapest candidate (first among ties), or a softmax draw over normalised costs."""
    if temperature <= 0 or len(candidates) == 1:
        return candidates[min(range(len(candidates)), key=lambda i: costs[i])]
    top = max(max(costs), 1e-9)
    weights = [math.exp(-(c / top) / temperature) for c in costs]
    return rng.choices(list(candidates), weights=weights, k=1)[0]
