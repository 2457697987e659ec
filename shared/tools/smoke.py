"""``python -m shared.tools.smoke --url URL``: list the models, complete one request, exit 0 when both work.

The deployment check (``helm test``, the compose stack's health of the whole path).
Standard library and ``shared.flags`` only, so it runs in any Cleave image; sends
``--api-key`` (or ``CLEAVE_API_KEY``, e.g. from the chart's Secret) as a bearer token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

from shared import flags


def _call(url: str, api_key: str | None, body: dict | None = None, timeout_s: float = 60.0) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def smoke(base_url: str, wait_s: float, api_key: str | None = None) -> str:
    """The text of one completion from the first listed model; retries until ``wait_s`` passes."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            models = _call(f"{base_url}/v1/models", api_key)["data"]
            model = models[0]["id"]
            completion = _call(
                f"{base_url}/v1/completions", api_key, {"model": model, "prompt": "Hello", "max_tokens": 8}
            )
            return completion["choices"][0]["text"]
        except (urllib.error.URLError, OSError, KeyError, IndexError) as e:
            if time.monotonic() > deadline:
                raise SystemExit(f"smoke: {base_url} did not complete a request: {e}") from e
            time.sleep(2.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shared.tools.smoke", description=__doc__)
    parser.add_argument("--url", required=True, help="router base URL, e.g. http://cleave-router:8000")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to keep retrying")
    parser.add_argument("--api-key", default=None, help="the router's --api-key, sent as a bearer token")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = flags.parse_args(build_parser(), argv)
    text = smoke(args.url.rstrip("/"), args.wait, args.api_key)
    print(f"smoke ok: {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
