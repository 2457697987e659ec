"""Router settings: one frozen dataclass, filled from flags or ``CLEAVE_*`` env vars.

Every flag ``--some-flag`` can also be set with ``CLEAVE_SOME_FLAG``; a flag on
the command line wins over the environment. Repeatable flags (worker addresses)
take a comma-separated list in the environment, e.g.
``CLEAVE_DECODE_WORKER=10.0.0.5:50061,10.0.0.6:50061``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ROUTING_POLICIES = ("least_loaded", "round_robin")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class RouterSettings:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_workers: tuple[str, ...] = ()
    decode_workers: tuple[str, ...] = ()
    served_model_name: str | None = None
    max_model_len: int | None = None
    routing_policy: str = "least_loaded"
    disagg_min_prompt_tokens: int = 0
    health_interval_s: float = 2.0
    rpc_timeout_s: float = 600.0
    log_level: str = "info"
    max_request_body_bytes: int = 8 << 20
    max_choices_per_request: int = 256

    @property
    def model_name(self) -> str:
        """Name clients must send as ``model`` (defaults to the model directory)."""
        return self.served_model_name or self.model


def _env_name(flag: str) -> str:
    return "CLEAVE_" + flag.lstrip("-").replace("-", "_").upper()


def _split_addrs(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """Parser whose defaults come from ``env``; ``--help`` lists the env var of every flag."""
    parser = argparse.ArgumentParser(
        prog="python -m services.router",
        description=(
            "Cleave router: OpenAI-compatible HTTP API in front of prefill and decode workers. "
            "With prefill workers it runs disaggregated (prefill there, KV pulled by a decode worker); "
            "without them every request goes to a decode worker (aggregated). "
            "Every flag can also be set through the environment variable shown in brackets."
        ),
    )

    def add(flag: str, help_text: str, **kwargs) -> None:
        name = _env_name(flag)
        # Repeatable flags resolve their env value after parsing, so that flags replace it.
        if name in env and kwargs.get("action") != "append":
            kwargs["default"] = kwargs.get("type", str)(env[name])
            kwargs["required"] = False
        parser.add_argument(flag, help=f"{help_text} [{name}]", **kwargs)

    add("--model", "model directory (Hugging Face layout: config.json, tokenizer.json) or a .gguf file", required=True)
    add("--host", "address to bind", default="127.0.0.1")
    add("--port", "port to bind", type=int, default=8000)
    add(
        "--prefill-worker",
        "prefill worker gRPC address host:port; repeat for several (comma-separated in the env var)",
        action="append",
        dest="prefill_worker",
    )
    add(
        "--decode-worker",
        "decode worker gRPC address host:port; repeat for several (comma-separated in the env var)",
        action="append",
        dest="decode_worker",
    )
    add("--served-model-name", "model name clients send in requests (default: the --model value)")
    add("--max-model-len", "context length override (default: from config.json)", type=int)
    add("--routing-policy", "how to choose among workers", choices=ROUTING_POLICIES, default="least_loaded")
    add(
        "--disagg-min-prompt-tokens",
        "prompts shorter than this skip the prefill pool and run aggregated on a decode worker",
        type=int,
        default=0,
    )
    add("--health-interval", "seconds between worker health/load polls", type=float, default=2.0)
    add("--rpc-timeout", "deadline in seconds for one worker call (whole generation stream)", type=float, default=600.0)
    add("--log-level", "log level", type=str.lower, choices=LOG_LEVELS, default="info")
    add(
        "--max-request-body-bytes",
        "largest request body accepted; larger ones are answered 413 before they are parsed",
        type=int,
        default=8 << 20,
    )
    add(
        "--max-choices-per-request",
        "most choices (prompts x n) one request may ask for; more are answered 400",
        type=int,
        default=256,
    )
    return parser


def parse_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> RouterSettings:
    """Flags first, then ``CLEAVE_*`` env vars, then defaults."""
    env = os.environ if env is None else env
    parser = build_parser(env)
    args = parser.parse_args(argv)
    if args.port < 0 or args.port > 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if args.max_model_len is not None and args.max_model_len < 1:
        parser.error(f"--max-model-len must be >= 1, got {args.max_model_len}")
    if args.health_interval <= 0:
        parser.error(f"--health-interval must be > 0, got {args.health_interval}")
    if args.max_request_body_bytes < 1:
        parser.error(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    if args.max_choices_per_request < 1:
        parser.error(f"--max-choices-per-request must be >= 1, got {args.max_choices_per_request}")
    prefill_workers = args.prefill_worker or _split_addrs(env.get(_env_name("--prefill-worker"), ""))
    decode_workers = args.decode_worker or _split_addrs(env.get(_env_name("--decode-worker"), ""))
    return RouterSettings(
        model=args.model,
        host=args.host,
        port=args.port,
        prefill_workers=tuple(prefill_workers),
        decode_workers=tuple(decode_workers),
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        routing_policy=args.routing_policy,
        disagg_min_prompt_tokens=args.disagg_min_prompt_tokens,
        health_interval_s=args.health_interval,
        rpc_timeout_s=args.rpc_timeout,
        log_level=args.log_level,
        max_request_body_bytes=args.max_request_body_bytes,
        max_choices_per_request=args.max_choices_per_request,
    )
