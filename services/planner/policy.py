"""The planner's decisions as pure functions: a latency series in, a replica count out.

The prefill pool is sized to hold a time-to-first-token target, the decode pool
an inter-token-latency target. A pool scales up only on a sustained breach (the
last ``breach_samples`` all above target), scales down one replica at a time
only after a sustained calm (the last ``calm_samples`` all below
``calm_ratio`` x target, or no traffic), never changes within ``cooldown_s`` of
its last change, and stays within [min_replicas, max_replicas].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolPolicy:
    target_s: float
    min_replicas: int = 1
    max_replicas: int = 8
    breach_samples: int = 3
    calm_samples: int = 6
    calm_ratio: float = 0.5
    cooldown_s: float = 300.0
    max_step_up: int = 4

    def __post_init__(self) -> None:
        if self.target_s <= 0:
            raise ValueError(f"latency target must be > 0 seconds, got {self.target_s}")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}..{self.max_replicas}")
        if self.breach_samples < 1 or self.calm_samples < 1:
            raise ValueError("breach_samples and calm_samples must be >= 1")


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str  # one of: hold, bounds, cooldown, scale_up, scale_down

    def changes(self, current: int) -> bool:
        return self.replicas != current


def decide(
    policy: PoolPolicy,
    latencies: Sequence[float | None],  # oldest first; None: no traffic in that interval
    current: int,
    now_s: float,
    last_change_s: float | None,
) -> Decision:
    """The replica count the pool should have now."""
    bounded = min(max(current, policy.min_replicas), policy.max_replicas)
    if bounded != current:
        return Decision(bounded, "bounds")
    if last_change_s is not None and now_s - last_change_s < policy.cooldown_s:
        return Decision(current, "cooldown")
    recent = latencies[-policy.breach_samples :]
    if len(recent) == policy.breach_samples and all(x is not None and x > policy.target_s for x in recent):
        worst_ratio = min(x for x in recent if x is not None) / policy.target_s
        # Latency roughly scales with load per replica: grow by the sustained excess, bounded.
        wanted = max(current + 1, math.ceil(max(current, 1) * worst_ratio))
        wanted = min(wanted, current + policy.max_step_up, policy.max_replicas)
        return Decision(wanted, "scale_up") if wanted != current else Decision(current, "hold")
    calm = latencies[-policy.calm_samples :]
    limit = policy.target_s * policy.calm_ratio
    if len(calm) == policy.calm_samples and all(x is None or x < limit for x in calm):
        if current > policy.min_replicas:
            return Decision(current - 1, "scale_down")
    return Decision(current, "hold")


def simulate(
    policy: PoolPolicy, series: Sequence[float | None], start: int, interval_s: float
) -> list[tuple[float, int, str]]:
    """Replay a recorded series sample by sample: (time, replicas, reason) of every change."""
    replicas, last_change, changes = start, None, []
    for i in range(len(series)):
        now = i * interval_s
        d = decide(policy, series[: i + 1], replicas, now, last_change)
        if d.changes(replicas):
            replicas, last_change = d.replicas, now
            changes.append((now, replicas, d.reason))
    return changes
