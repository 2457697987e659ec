"""A prefill worker restarted on the same address: the decode worker handshakes again
and pulls (no recompute); a handle from before the restart is recomputed, never read."""

from __future__ import annotations

import grpc
import pytest

from tests.integration.cluster import start_worker, wait_worker
from tests.integration.test_kv_faults import expected, generate, prefill  # noqa: F401  (fixture)


def restart_prefill(model_dir, port: str | None = None):
    extra = ["--kv-transfer-backend", "tcp"] + (["--port", port] if port else [])
    return wait_worker(start_worker("prefill", model_dir, *extra))


@pytest.mark.slow
def test_restarted_prefill_worker_is_handshaken_again(model_dir, expected):  # noqa: F811
    first_prefill = restart_prefill(model_dir)
    port = first_prefill.info["grpc"].rsplit(":", 1)[1]
    decode = wait_worker(start_worker("decode", model_dir, "--kv-transfer-backend", "tcp",
                                      "--kv-pull-failure-policy", "fail"))  # fmt: skip
    procs = [first_prefill, decode]
    try:
        tokens, head = generate(decode, "before", prefill(first_prefill, "before"))
        assert tokens == expected and not head.kv_recomputed
        stale = prefill(first_prefill, "stale")  # a handle whose KV dies with the process
        first_prefill.stop(sig=9)
        second = restart_prefill(model_dir, port)
        procs.append(second)
        for i in range(3):  # every pull after the restart works, with the fail policy too
            tokens, head = generate(decode, f"after-{i}", prefill(second, f"after-{i}"))
            assert tokens == expected and not head.kv_recomputed and head.kv_transfer_bytes > 0
        with pytest.raises(grpc.RpcError) as err:
            generate(decode, "stale", stale)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "restarted" in err.value.details()
    finally:
        for p in procs:
            p.stop()
