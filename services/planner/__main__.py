"""``python -m services.planner`` (``cleave planner``): keep both pools at their latency targets."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from services.planner.policy import PoolPolicy, decide
from shared import flags

logger = logging.getLogger("cleave.planner")
HISTORY = 64


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cleave planner",
        description="Sets the replica counts of the prefill and decode Deployments through the Kubernetes API: "
        "the prefill pool holds a time-to-first-token target, the decode pool an inter-token-latency target. "
        "Every flag can also be set with the CLEAVE_* variable shown in brackets.",
    )
    p.add_argument("--prometheus-url", required=True, help="Prometheus that scrapes the router")
    p.add_argument("--namespace", default="default", help="namespace of the two Deployments")
    p.add_argument("--prefill-deployment", default="cleave-prefill")
    p.add_argument("--decode-deployment", default="cleave-decode")
    p.add_argument("--ttft-target", type=float, default=1.0, help="seconds, p90 time to first token")
    p.add_argument("--itl-target", type=float, default=0.05, help="seconds, p90 inter-token latency")
    for pool in ("prefill", "decode"):
        p.add_argument(f"--{pool}-min-replicas", type=int, default=1)
        p.add_argument(f"--{pool}-max-replicas", type=int, default=8)
    p.add_argument("--interval", type=float, default=30.0, help="seconds between decisions")
    p.add_argument("--cooldown", type=float, default=300.0, help="seconds a pool holds after a change")
    p.add_argument("--dry-run", action="store_true", help="log the decisions, change nothing")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig path (default: in-cluster, then ~/.kube/config)")
    p.add_argument("--once", action="store_true", help="decide once and exit")
    p.add_argument("--log-level", default="INFO")
    return p


@dataclass
class Pool:
    name: str  # the Deployment
    policy: PoolPolicy
    read_latency: object  # () -> float | None
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    last_change_s: float | None = None


def step(pools: list[Pool], scaler, now_s: float, dry_run: bool) -> dict[str, int]:
    """One decision per pool; returns the replica count each should have."""
    out = {}
    for pool in pools:
        pool.history.append(pool.read_latency())  # type: ignore[operator]
        current = scaler.replicas(pool.name)
        d = decide(pool.policy, list(pool.history), current, now_s, pool.last_change_s)
        logger.info("planner_decision deployment=%s latency=%s current=%d wanted=%d reason=%s dry_run=%s",
                    pool.name, pool.history[-1], current, d.replicas, d.reason, dry_run)  # fmt: skip
        if d.changes(current):
            if not dry_run:
                scaler.set_replicas(pool.name, d.replicas)
            pool.last_change_s = now_s
        out[pool.name] = d.replicas
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = flags.parse_args(parser, argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    from services.planner.kube import DeploymentScaler, api_client
    from services.planner.load import PrometheusLoad

    try:
        policies = {
            pool: PoolPolicy(
                target,
                getattr(args, f"{pool}_min_replicas"),
                getattr(args, f"{pool}_max_replicas"),
                cooldown_s=args.cooldown,
            )  # fmt: skip
            for pool, target in (("prefill", args.ttft_target), ("decode", args.itl_target))
        }
    except ValueError as e:
        parser.error(str(e))
    load = PrometheusLoad(args.prometheus_url)
    pools = [
        Pool(args.prefill_deployment, policies["prefill"], load.ttft_s),
        Pool(args.decode_deployment, policies["decode"], load.itl_s),
    ]
    scaler = DeploymentScaler(api_client(args.kubeconfig), args.namespace)
    while True:
        try:
            step(pools, scaler, time.monotonic(), args.dry_run)
        except Exception as e:  # an unreachable API or Prometheus: log, keep the replicas, try again
            logger.warning("planner_step_failed error=%r", e)
        if args.once:
            return 0
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
