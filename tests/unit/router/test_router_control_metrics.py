"""The router's control-plane series: retries, 429s, request timeouts, pool sizes and, with a real
redis-server, Redis connectivity through an outage and the KV index size."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from services.router.discovery import RegistryWatcher
from services.router.kv_index import KVIndex
from services.router.kv_routing import KVRouter
from services.router.metrics import RouterMetrics
from services.router.state_metrics import RouterStateCollector
from services.router.workers import WorkerPools
from tests.unit.router.conftest import MODEL_NAME

DEAD = "127.0.0.1:1"  # nothing listens on port 1


def post(router, body: dict) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/completions", json={"model": MODEL_NAME, **body}, timeout=30)


def value(router, name: str, **labels: str) -> float:
    sample = router.state.metrics.registry.get_sample_value(name, labels)
    assert sample is not None, f"{name}{labels} is not exported"
    return sample


def test_every_label_set_is_exported_at_zero(agg_router):
    text = httpx.get(f"{agg_router.url}/metrics").text
    for line in (
        'cleave_router_retries_total{role="prefill"}',
        'cleave_router_retries_total{role="decode"}',
        'cleave_router_migrations_total{outcome="migrated"}',
        'cleave_router_migrations_total{outcome="refused"}',
        'cleave_router_migrations_total{outcome="no_worker"}',
        'cleave_router_rejected_requests_total{role="decode"}',
        "cleave_router_request_timeouts_total",
    ):
        assert line in text, line
    assert value(agg_router, "cleave_router_pool_workers", role="decode", source="static") == 1
    assert value(agg_router, "cleave_router_pool_workers", role="prefill", source="static") == 0
    assert "cleave_router_redis_up" not in text  # no --redis-url: nothing to report


def test_call_to_a_worker_that_died_between_polls_is_retried_and_counted(router_factory, worker_addrs):
    router = router_factory(prefill=False, decode=[DEAD, worker_addrs["decode"]])
    dead = next(w for w in router.state.pools.decode.workers if w.address == DEAD)
    before = value(router, "cleave_router_retries_total", role="decode")
    deadline = time.monotonic() + 20
    # The router believes the dead worker healthy, as it would between two health polls; the rotating
    # pick reaches it within a few requests.
    while value(router, "cleave_router_retries_total", role="decode") == before:
        assert time.monotonic() < deadline, "no request was ever sent to the dead worker"
        dead.healthy = True
        assert post(router, {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_429_and_timeouts_are_counted(router_factory, script):
    router = router_factory(prefill=False, max_queued_requests=1, request_timeout_s=0.5)
    rejected = value(router, "cleave_router_rejected_requests_total", role="decode")
    timeouts = value(router, "cleave_router_request_timeouts_total")
    script.delay_s = 0.1  # per message: 100 tokens outlive the 0.5 s deadline
    first = threading.Thread(target=lambda: post(router, {"prompt": "Hi", "max_tokens": 100}))
    first.start()
    deadline = time.monotonic() + 10
    while router.state.pools.decode.workers[0].num_in_flight == 0:
        assert time.monotonic() < deadline, "the first request never reached the worker"
        time.sleep(0.01)
    assert post(router, {"prompt": "Hi", "max_tokens": 2}).status_code == 429
    first.join(timeout=30)
    assert value(router, "cleave_router_rejected_requests_total", role="decode") == rejected + 1
    assert value(router, "cleave_router_request_timeouts_total") == timeouts + 1


def scrape(collector: RouterStateCollector) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in collector.collect() for s in m.samples}


class _State:
    """The parts of ``RouterState`` the collector reads."""

    def __init__(self, pools: WorkerPools, watcher: RegistryWatcher, kv_router: KVRouter) -> None:
        self.pools, self.watcher, self.kv_router, self.kv_reader = pools, watcher, kv_router, None


def test_redis_up_and_reconnects_through_an_outage(redis_server):
    up = ("cleave_router_redis_up", (("component", "registry"),))
    reconnects = ("cleave_router_redis_reconnects_total", (("component", "registry"),))

    async def until(collector, key, wanted, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while scrape(collector).get(key) != wanted:
            assert time.monotonic() < deadline, f"{key} never became {wanted}: {scrape(collector)}"
            await asyncio.sleep(0.05)

    async def main() -> None:
        pools = WorkerPools((), (DEAD,), "least_loaded", RouterMetrics())
        watcher = RegistryWatcher(redis_server.url, pools, interval_s=0.1)
        index = KVIndex(max_entries=2)
        collector = RouterStateCollector(_State(pools, watcher, KVRouter(index, watcher)))
        assert scrape(collector)[up] == 0  # not read yet
        task = asyncio.create_task(watcher.run())
        try:
            await until(collector, up, 1)
            assert scrape(collector)[reconnects] == 0
            redis_server.stop()
            await until(collector, up, 0)
            redis_server.start()
            await until(collector, up, 1)
            assert scrape(collector)[reconnects] == 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await watcher.close()
            await pools.close()
        index.store("w1", [b"a", b"b", b"c"])
        samples = scrape(collector)
        assert samples[("cleave_router_kv_index_entries", ())] == 2
        assert samples[("cleave_router_kv_index_dropped_total", ())] == 1
        assert samples[("cleave_router_pool_workers", (("role", "decode"), ("source", "static")))] == 1

    asyncio.run(main())
