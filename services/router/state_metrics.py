"""Router series read from its control-plane state at scrape time (``cleave_router_*``).

Pool sizes, Redis connectivity and the KV index are state the router already
holds; a collector reads it when Prometheus scrapes, so no code path has to
remember to update a gauge.

- ``cleave_router_pool_workers{role,source}``: workers in each pool, from the
  static flags (``source="static"``) or the Redis registry (``"registry"``).
- ``cleave_router_worker_queued{role,address}``: each healthy worker's queue as
  the router counts it for ``--max-queued-requests`` (its last reported queue
  plus the router's calls sent since).
- ``cleave_router_redis_up{component}`` and ``cleave_router_redis_reconnects_total``:
  whether the last Redis call of the registry watcher (``component="registry"``)
  and of the KV event reader (``"kv_events"``) succeeded, and how many outages
  ended; only with ``--redis-url``.
- ``cleave_router_kv_index_entries`` and ``cleave_router_kv_index_dropped_total``:
  (block hash, worker) pairs in the KV index, and those dropped to stay within
  ``--kv-index-max-entries``; only under ``--routing-policy kv_aware``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.router.metrics import ROLES


class RouterStateCollector(Collector):
    """Reads ``state`` (a ``RouterState``) on every scrape."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        yield self._pool_workers()
        yield self._queued()
        yield from self._redis()
        yield from self._kv_index()

    def _pool_workers(self) -> Metric:
        family = GaugeMetricFamily(
            "cleave_router_pool_workers",
            "Workers in each pool, by role and source (static flags or the Redis registry).",
            labels=["role", "source"],
        )
        pools = self.state.pools
        for role in ROLES:
            workers = getattr(pools, role).workers if pools is not None else []
            discovered = sum(1 for w in workers if w.discovered)
            family.add_metric([role, "static"], len(workers) - discovered)
            family.add_metric([role, "registry"], discovered)
        return family

    def _queued(self) -> Metric:
        family = GaugeMetricFamily(
            "cleave_router_worker_queued",
            "Requests queued on each healthy worker as the router counts them for --max-queued-requests: "
            "the queue it reported at the last load poll plus the router's calls sent since.",
            labels=["role", "address"],
        )
        pools = self.state.pools
        for role in ROLES:
            for worker in getattr(pools, role).healthy_workers() if pools is not None else []:
                family.add_metric([role, worker.address], worker.num_queued)
        return family

    def _redis(self) -> Iterator[Metric]:
        clients = {"registry": self.state.watcher, "kv_events": self.state.kv_reader}
        clients = {name: c for name, c in clients.items() if c is not None}
        if not clients:
            return
        up = GaugeMetricFamily(
            "cleave_router_redis_up",
            "1 when the router's last Redis call succeeded, by component.",
            labels=["component"],
        )
        reconnects = CounterMetricFamily(
            "cleave_router_redis_reconnects",
            "Redis outages that ended (the component reached Redis again), by component.",
            labels=["component"],
        )
        for name, client in clients.items():
            up.add_metric([name], 1.0 if client.backoff.up else 0.0)
            reconnects.add_metric([name], client.backoff.num_reconnects)
        yield up
        yield reconnects

    def _kv_index(self) -> Iterator[Metric]:
        if self.state.kv_router is None:
            return
        index = self.state.kv_router.index
        yield GaugeMetricFamily(
            "cleave_router_kv_index_entries", "(block hash, worker) pairs in the router's KV index.", value=len(index)
        )
        yield CounterMetricFamily(
            "cleave_router_kv_index_dropped",
            "KV index entries dropped, oldest first, to stay within --kv-index-max-entries.",
            value=index.num_dropped,
        )
