"""The ``cleave`` command.

Every flag can also be set with an environment variable ``CLEAVE_<FLAG>``
(upper case, dashes as underscores), e.g. ``CLEAVE_KV_CACHE_MEMORY=4GiB``;
``shared.flags`` is the one layer that reads them, for every command.
Services are started by module name (``python -m services...``); this module
never imports them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from shared import flags
from shared.config import KV_CACHE_DTYPES, OVERTAKE_MAX_WAIT_S, SCHEDULING_POLICIES, EngineConfig
from shared.models.default_model import DEFAULT_MODEL_DIR, DEMO_MODEL_DIR, resolve_model

__all__ = ["DEFAULT_MODEL_DIR", "add_engine_args", "engine_config_from_args", "env_default", "main"]


def parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    if value and value[-1] in units:
        return int(float(value[:-1]) * units[value[-1]])
    return int(value)


def env_default(flag: str, default):
    """The flag's default as written; ``shared.flags`` applies ``CLEAVE_*`` values when parsing."""
    return default


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by ``generate``, the workers and the throughput benchmark."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=env_default("--model", DEFAULT_MODEL_DIR),
        help="Hugging Face checkpoint directory, a .gguf file, or 'demo' for the random-weight demo model "
        f"(default: SmolLM2-135M-Instruct, converted into {DEFAULT_MODEL_DIR} on first use)",
    )
    dtypes = {
        "--dtype": "weights and KV cache dtype; auto: bfloat16 on CUDA; on CPU float32 (its native kernels), "
        "but bfloat16 for a bfloat16 checkpoint over 1B parameters. On CPU a bfloat16 checkpoint in float32, "
        "and bfloat16, run bfloat16 weights on the native float32 kernels: where the CPU has AVX512-BF16 or AMX "
        "at any size, the projections on its bfloat16 products (inputs rounded to bfloat16) and the weights "
        "held as bfloat16 (2 bytes a value); without them up to 1B parameters, as float32 values (above: "
        "torch's bfloat16 operators)",
        "--kv-cache-dtype": "KV cache dtype; auto: the model's, but bfloat16 where --dtype auto runs a bfloat16 "
        "checkpoint in float32 on the CPU (half the bytes per token, the checkpoint's own precision); on CUDA "
        "the model's. fp8 (fp8_e4m3) and fp8_e5m2, on the CPU: a quarter of float32's bytes per token (four "
        "times the tokens in --kv-cache-memory, a quarter of what decode attention reads), K and V rounded to "
        "3 (e4m3) or 2 (e5m2) mantissa bits and saturated at 448 (e4m3) or 57344 (e5m2), without a scale",
    }
    for flag, text in dtypes.items():
        choices = KV_CACHE_DTYPES if flag == "--kv-cache-dtype" else ("auto", "float32", "bfloat16")
        g.add_argument(flag, default=env_default(flag, "auto"), choices=choices, help=text)
    g.add_argument("--device", default=env_default("--device", "auto"), help="auto, cpu or cuda")
    g.add_argument("--block-size", type=int, default=int(env_default("--block-size", 16)), help="tokens per KV block")
    g.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=parse_bytes(str(env_default("--kv-cache-memory", "2GiB"))),
        help="KV cache budget on CPU, e.g. 512MiB, 4GiB",
    )
    g.add_argument(
        "--no-kv-cache-prefault",
        action="store_true",
        default=bool(env_default("--no-kv-cache-prefault", "")),
        help="CPU: leave the KV cache's pages to be supplied as its blocks are first used (resident memory then "
        "grows with use, and those first steps wait on page faults) instead of making the whole budget resident "
        "at start",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=float(env_default("--gpu-memory-utilization", 0.9)),
        help="fraction of GPU memory to use (CUDA)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=int(env_default("--max-num-batched-tokens", 0)),
        help="token budget per engine step; 0: 2048 on CUDA; on CPU the power of two from 256 to 2048 whose "
        "tokens take about 20 GFLOP of the model's projections (a step of about 0.2 s on two cores, and so a short "
        "wait for an abort to free blocks): 256 for the default SmolLM2-135M, 1024 for a 12M-parameter Llama, 2048 "
        "for the random-weight demo model",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=int(env_default("--max-num-seqs", 256)), help="running requests at most"
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=env_default("--max-model-len", None),
        help="context length (default: the model's)",
    )
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        default=bool(env_default("--no-prefix-caching", "")),
        help="disable automatic prefix caching",
    )
    g.add_argument(
        "--attention-backend", default=env_default("--attention-backend", "auto"), choices=["auto", "torch", "triton"]
    )
    g.add_argument(
        "--scheduling-policy",
        default=env_default("--scheduling-policy", "shortest-first"),
        choices=list(SCHEDULING_POLICIES),
        help="the order waiting requests start in: shortest-first (the fewest prompt tokens first, so a burst's "
        "short prompts do not queue behind its long ones; a request that has waited "
        f"{OVERTAKE_MAX_WAIT_S:g} s is no longer overtaken by later ones) or fcfs (arrival order); a preempted "
        "request always goes first",
    )
    g.add_argument("--enforce-eager", action="store_true", default=bool(env_default("--enforce-eager", "")), help="CUDA: no CUDA graphs")  # fmt: skip


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=resolve_model(args.model),
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_prefault=not args.no_kv_cache_prefault,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=int(args.max_model_len) if args.max_model_len else None,
        enable_prefix_caching=not args.no_prefix_caching,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        scheduling_policy=args.scheduling_policy,
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("-n", type=int, default=1, help="completions per prompt")


def cmd_generate(args: argparse.Namespace) -> int:
    from shared.engine import LLM, InvalidRequestError, SamplingParams

    try:
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            seed=args.seed, presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens, stop=args.stop,
            ignore_eos=args.ignore_eos,
        )  # fmt: skip
        config = engine_config_from_args(args)
        llm = LLM(**{k: v for k, v in vars(config).items()})
        prompt: str | list[int] = args.prompt
        if args.chat:
            # The template carries its own special tokens; encode it without adding more.
            text = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
            prompt = llm.tokenizer.encode(text, add_special_tokens=False)
        (result,) = llm.generate([prompt], params)
    except (InvalidRequestError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for completion in result.outputs:
        print(completion.text)
    return 0


def cmd_demo_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.if_missing and (Path(args.dir) / "config.json").is_file():
        print(f"demo model already in {args.dir}")
        return 0
    from shared.models.demo import write_demo_model

    path = write_demo_model(args.dir, seed=args.seed)
    print(f"demo model written to {path}")
    return 0


def cmd_convert_gguf(args: argparse.Namespace) -> int:
    from shared.models.config import ModelLoadError
    from shared.models.gguf_convert import convert_gguf

    try:
        path = convert_gguf(args.file, args.dir)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.file} converted to {path}")
    return 0


def _exec_module(module: str, argv: list[str]) -> int:
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])
    return 0  # not reached


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="cleave", description="Cleave: disaggregated prefill/decode LLM serving.")
    parser.add_argument("--log-level", default=env_default("--log-level", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete one prompt offline and print the text")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo-model", help="write the small random-weight demo checkpoint")
    p.add_argument("dir", nargs="?", default=DEMO_MODEL_DIR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--if-missing", action="store_true", help="do nothing when DIR already holds a checkpoint")
    p.set_defaults(func=cmd_demo_model)

    p = sub.add_parser(
        "convert-gguf",
        help="write a GGUF checkpoint as a Hugging Face directory (float32 safetensors, config, tokenizer, chat template)",
    )
    p.add_argument("file", help="the .gguf file (llama, qwen2 or qwen3 architecture)")
    p.add_argument("dir", help="output directory (must not exist, or be empty)")
    p.set_defaults(func=cmd_convert_gguf)

    passthrough = {
        "serve": ("shared.launcher", "start router + prefill + decode workers as processes"),
        "router": ("services.router", "start the OpenAI-compatible router"),
        "prefill-worker": ("services.prefill_worker", "start a prefill worker (gRPC)"),
        "decode-worker": ("services.decode_worker", "start a decode worker (gRPC)"),
        "planner": ("services.planner", "scale the prefill and decode Deployments to latency targets (Kubernetes)"),
    }
    for name, (module, help_text) in passthrough.items():
        p = sub.add_parser(name, help=help_text + f" (see `cleave {name} --help`)", add_help=False)
        p.set_defaults(module=module)

    p = sub.add_parser(
        "bench", help="benchmarks that print JSON (`cleave bench throughput|serve|structured --help`)", add_help=False
    )
    p.set_defaults(module="shared.bench")
    return parser, passthrough


def _chosen_subparser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser | None:
    """The parser of the subcommand named in ``argv``: only its flags read the environment."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    name = next((arg for arg in argv if arg in sub.choices), None)
    return None if name is None else sub.choices[name]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, _ = build_parser()
    chosen = _chosen_subparser(parser, argv)
    if chosen is not None:
        flags.apply_env(chosen)
    args, rest = flags.parse_known_args(parser, argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if getattr(args, "module", None):
        index = argv.index(args.command)
        return _exec_module(args.module, argv[index + 1 :])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
