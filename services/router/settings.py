"""Router settings: one frozen dataclass, filled from flags or ``CLEAVE_*`` env vars.

Every flag ``--some-flag`` can also be set with ``CLEAVE_SOME_FLAG``; a flag on
the command line wins over the environment (``shared.flags``, the layer every
command shares). Repeatable flags (worker addresses) take a comma-separated
list in the environment, e.g.
``CLEAVE_DECODE_WORKER=10.0.0.5:50061,10.0.0.6:50061``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shared import flags
from shared.logs import LOG_FORMATS

ROUTING_POLICIES = ("kv_aware", "least_loaded", "round_robin")
LOG_LEVELS = ("debug", "info", "warning", "error")
WORKER_STREAMS = ("shared", "per-call")
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
FIRST_TOKEN_AT = ("decode", "prefill")


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
    first_token_at: str = "decode"
    health_interval_s: float = 2.0
    rpc_timeout_s: float = 600.0
    worker_streams: str = "shared"
    log_level: str = "info"
    redis_url: str | None = None
    kv_overlap_weight: float = 1.0
    router_temperature: float = 0.0
    disagg_min_uncached_tokens: int = 128
    kv_index_max_entries: int = 1_000_000
    migration_limit: int = 3
    api_key: str | None = field(default=None, repr=False)
    max_queued_requests: int = 0
    request_timeout_s: float | None = None
    otlp_traces_endpoint: str | None = None
    log_format: str = "text"
    tool_call_parser: str | None = None  # how tool_choice "auto" reads calls from the model's text
    max_request_body_bytes: int = 8 << 20
    max_choices_per_request: int = 256

    @property
    def model_name(self) -> str:
        """Name clients must send as ``model`` (defaults to the model directory)."""
        return self.served_model_name or self.model


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The router's flags; ``shared.flags.parse_args`` fills their defaults from ``env``."""
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
        parser.add_argument(flag, help=help_text, **kwargs)

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
    add(
        "--routing-policy",
        "how to choose among workers; kv_aware (the default with --redis-url) weighs each worker's cached "
        "prefix of the prompt against its queued work and needs the workers' KV events in Redis",
        choices=ROUTING_POLICIES,
    )
    add(
        "--disagg-min-prompt-tokens",
        "prompts shorter than this skip the prefill pool and run aggregated on a decode worker",
        type=int,
        default=0,
    )
    add(
        "--first-token-at",
        "disaggregated requests: when the client gets the first token, which the prefill worker samples. "
        "decode (default): once a decode worker has pulled the request's KV and queued it, so the tokens then "
        "come at the pace of its steps; prefill: at once, earlier by the pull and the wait for the decode "
        "worker's next step, which the client then sees as a pause after the first token",
        choices=FIRST_TOKEN_AT,
        default="decode",
    )
    add(
        "--kv-overlap-weight",
        "kv_aware: cost of one prompt block a worker must compute, against one block of queued work",
        type=float,
        default=1.0,
    )
    add(
        "--router-temperature",
        "kv_aware: 0 picks the cheapest worker; above 0 draws among near-equals (softmax of normalised cost)",
        type=float,
        default=0.0,
    )
    add(
        "--disagg-min-uncached-tokens",
        "kv_aware: when the chosen decode worker's cache leaves fewer prompt tokens than this to compute, "
        "it runs the request whole (no remote prefill)",
        type=int,
        default=128,
    )
    add("--kv-index-max-entries", "kv_aware: bound on (block, worker) entries in the router's index", type=int,
        default=1_000_000)  # fmt: skip
    add(
        "--migration-limit",
        "times a stream whose decode worker fails mid-generation moves to another one (prompt plus the "
        "tokens so far); 0: the client gets an error event instead",
        type=int,
        default=3,
    )
    add("--api-key", "require 'Authorization: Bearer <key>' on /v1/* (/health and /metrics stay open)")
    add(
        "--max-queued-requests",
        "answer 429 with Retry-After when every worker of a pool has this many requests queued: the queue "
        "it reported at the last load poll plus this router's calls sent since (0: no limit)",
        type=int,
        default=0,
    )
    add("--request-timeout", "seconds a whole request (stream included) may run before a 504 (default: none)",
        type=float)  # fmt: skip
    add("--health-interval", "seconds between worker health/load polls", type=float, default=2.0)
    add("--rpc-timeout", "deadline in seconds for one worker call (whole generation stream)", type=float, default=600.0)
    add("--worker-streams", "how generation calls reach a decode worker: shared (one gRPC stream per worker "
        "carries them all, a step's tokens in one message) or per-call (one Generate RPC each)",
        choices=WORKER_STREAMS, default="shared")  # fmt: skip
    add("--log-level", "log level", type=str.lower, choices=LOG_LEVELS, default="info")
    add("--log-format", "text, or json for one JSON object per log line", choices=LOG_FORMATS, default="text")
    add("--otlp-traces-endpoint", "OTLP/gRPC collector URL for OpenTelemetry traces, e.g. http://127.0.0.1:4317 "
        "(default: off, nothing exported)")  # fmt: skip
    add(
        "--tool-call-parser",
        "how tool_choice 'auto' finds tool calls in the model's text: hermes (<tool_call>{json}</tool_call>, "
        "Qwen) or llama3_json; without it, tools need tool_choice 'required', 'none' or a named function",
        choices=TOOL_CALL_PARSERS,
    )
    add(
        "--redis-url",
        "discover workers in this Redis registry (e.g. redis://127.0.0.1:6379/0), beside any static workers",
    )
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
    args = flags.parse_args(parser, argv, env)
    if args.port < 0 or args.port > 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if args.max_model_len is not None and args.max_model_len < 1:
        parser.error(f"--max-model-len must be >= 1, got {args.max_model_len}")
    if args.health_interval <= 0:
        parser.error(f"--health-interval must be > 0, got {args.health_interval}")
    policy = args.routing_policy or ("kv_aware" if args.redis_url else "least_loaded")
    if policy == "kv_aware" and not args.redis_url:
        parser.error("--routing-policy kv_aware needs --redis-url (the workers publish their KV events there)")
    if args.kv_overlap_weight < 0 or args.router_temperature < 0 or args.disagg_min_uncached_tokens < 0:
        parser.error("--kv-overlap-weight, --router-temperature and --disagg-min-uncached-tokens must be >= 0")
    if args.max_queued_requests < 0:
        parser.error(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if args.request_timeout is not None and args.request_timeout <= 0:
        parser.error(f"--request-timeout must be > 0, got {args.request_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        parser.error("--api-key must not be empty")
    if args.migration_limit < 0:
        parser.error(f"--migration-limit must be >= 0, got {args.migration_limit}")
    if args.kv_index_max_entries < 1:
        parser.error(f"--kv-index-max-entries must be >= 1, got {args.kv_index_max_entries}")
    if args.max_request_body_bytes < 1:
        parser.error(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    if args.max_choices_per_request < 1:
        parser.error(f"--max-choices-per-request must be >= 1, got {args.max_choices_per_request}")
    prefill_workers = args.prefill_worker or []
    decode_workers = args.decode_worker or []
    return RouterSettings(
        model=args.model,
        host=args.host,
        port=args.port,
        prefill_workers=tuple(prefill_workers),
        decode_workers=tuple(decode_workers),
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        routing_policy=policy,
        disagg_min_prompt_tokens=args.disagg_min_prompt_tokens,
        first_token_at=args.first_token_at,
        health_interval_s=args.health_interval,
        rpc_timeout_s=args.rpc_timeout,
        worker_streams=args.worker_streams,
        log_level=args.log_level,
        redis_url=args.redis_url,
        kv_overlap_weight=args.kv_overlap_weight,
        router_temperature=args.router_temperature,
        disagg_min_uncached_tokens=args.disagg_min_uncached_tokens,
        kv_index_max_entries=args.kv_index_max_entries,
        migration_limit=args.migration_limit,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        request_timeout_s=args.request_timeout,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        log_format=args.log_format,
        tool_call_parser=args.tool_call_parser,
        max_request_body_bytes=args.max_request_body_bytes,
        max_choices_per_request=args.max_choices_per_request,
    )
