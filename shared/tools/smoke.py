"""``python -m shared.tools.smoke --url URL``: list the models, complete one request, exit 0 when both work.

The deployment check (``helm test``, the compose stack's health of the whole path).
Standard library only, so it runs in any image; sends ``CLEAVE_API_KEY`` as a
bearer token when it is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request


def _call(url: str, body: dict | None = None, timeout_s: float = 60.0) -> dict:
    headers = {"Content-Type": "application/json"}
    if os.environ.get("CLEAVE_API_KEY"):
        headers["Authorization"] = "Bearer " + os.environ["CLEAVE_API_KEY"]
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def smoke(base_url: str, wait_s: float) -> str:
    """The text of one completion from the first listed model; retries until ``wait_s`` passes."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            models = _call(f"{base_url}/v1/models")["data"]
            model = models[0]["id"]
            completion = _call(f"{base_url}/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 8})
            return completion["choices"][0]["text"]
        except (urllib.error.URLError, OSError, KeyError, IndexError) as e:
            if time.monotonic() > deadline:
                raise SystemExit(f"smoke: {base_url} did not complete a request: {e}") from e
            time.sleep(2.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shared.tools.smoke", description=__doc__)
    parser.add_argument("--url", required=True, help="router base URL, e.g. http://cleave-router:8000")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to keep retrying")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    text = smoke(args.url.rstrip("/"), args.wait)
    print(f"smoke ok: {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
