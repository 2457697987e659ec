"""The planner's decisions on recorded latency series: scale on sustained breaches, never flap, keep bounds."""

from __future__ import annotations

import pytest

from services.planner.policy import PoolPolicy, decide, simulate

TTFT = PoolPolicy(target_s=1.0, min_replicas=1, max_replicas=6, cooldown_s=120.0)
INTERVAL_S = 30.0


def test_single_spike_is_ignored_and_sustained_breach_scales_up() -> None:
    spike = [0.6, 0.7, 3.0, 0.7, 0.6, 0.8, 0.7]
    assert simulate(TTFT, spike, start=2, interval_s=INTERVAL_S) == []
    # Three intervals at 1.5-2x the target: grow by the smallest sustained excess (1.5x of 2 -> 3).
    breach = [0.7, 1.6, 1.5, 2.0]
    assert simulate(TTFT, breach, start=2, interval_s=INTERVAL_S) == [(90.0, 3, "scale_up")]


def test_large_breach_is_bounded_by_step_and_max() -> None:
    policy = PoolPolicy(target_s=0.05, min_replicas=1, max_replicas=6, max_step_up=2, cooldown_s=0)
    assert decide(policy, [0.5, 0.5, 0.5], current=1, now_s=0, last_change_s=None).replicas == 3
    assert decide(policy, [0.5, 0.5, 0.5], current=5, now_s=0, last_change_s=None).replicas == 6
    assert decide(policy, [0.5, 0.5, 0.5], current=6, now_s=0, last_change_s=None).reason == "hold"


def test_oscillating_load_does_not_flap() -> None:
    # A recorded hour that swings around the target every few minutes.
    series = [1.3, 1.2, 1.4, 0.8, 0.9, 1.1, 1.3, 1.2, 0.7, 1.1, 1.2, 1.25, 0.9] * 9
    changes = simulate(TTFT, series, start=2, interval_s=INTERVAL_S)
    times = [t for t, _, _ in changes]
    assert all(later - earlier >= TTFT.cooldown_s for earlier, later in zip(times, times[1:], strict=False))
    # Never down: the series is never calm (below half the target).
    assert all(reason == "scale_up" for _, _, reason in changes)
    assert changes[-1][1] <= TTFT.max_replicas


def test_calm_and_idle_scale_down_one_at_a_time_to_min() -> None:
    idle = [None] * 40
    changes = simulate(TTFT, idle, start=4, interval_s=INTERVAL_S)
    assert [r for _, r, _ in changes] == [3, 2, 1]
    assert all(reason == "scale_down" for _, _, reason in changes)
    times = [t for t, _, _ in changes]
    assert all(b - a >= TTFT.cooldown_s for a, b in zip(times, times[1:], strict=False))


def test_cooldown_holds_and_bounds_win() -> None:
    assert decide(TTFT, [5.0] * 3, current=2, now_s=100, last_change_s=50).reason == "cooldown"
    assert decide(TTFT, [0.5], current=9, now_s=0, last_change_s=0).replicas == 6
    assert decide(TTFT, [0.5], current=0, now_s=0, last_change_s=None).replicas == 1


@pytest.mark.parametrize("kwargs", [{"target_s": 0}, {"target_s": 1, "min_replicas": 3, "max_replicas": 2}])
def test_bad_policy_is_refused(kwargs) -> None:
    with pytest.raises(ValueError):
        PoolPolicy(**kwargs)
