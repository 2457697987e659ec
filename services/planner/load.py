"""The pools' latency, read from Prometheus (the router's histograms).

TTFT holds the prefill pool to its target, inter-token latency the decode pool;
both as a quantile over the last ``window``. No traffic in the window reads as None.
"""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request

TTFT_METRIC = "cleave_router_time_to_first_token_seconds"
ITL_METRIC = "cleave_router_inter_token_latency_seconds"


def quantile_query(metric: str, quantile: float, window: str) -> str:
    return f"histogram_quantile({quantile}, sum by (le) (rate({metric}_bucket[{window}])))"


class PrometheusLoad:
    def __init__(self, base_url: str, quantile: float = 0.9, window: str = "2m", timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.quantile = quantile
        self.window = window
        self.timeout_s = timeout_s

    def _scalar(self, query: str) -> float | None:
        url = f"{self.base_url}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
            body = json.loads(response.read())
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus query failed: {body.get('error', body)}")
        result = body["data"]["result"]
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if math.isnan(value) else value

    def ttft_s(self) -> float | None:
        return self._scalar(quantile_query(TTFT_METRIC, self.quantile, self.window))

    def itl_s(self) -> float | None:
        return self._scalar(quantile_query(ITL_METRIC, self.quantile, self.window))
