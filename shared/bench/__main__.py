"""``cleave bench throughput|serve|fork``: benchmarks that print JSON."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: cleave bench {throughput,serve,observability,structured,fork} [--help]\n"
              "  throughput  offline generation throughput of cleave vs transformers (hf, hf-cb)\n"
              "  serve       load an OpenAI-compatible server with Poisson arrivals, vLLM-style latency metrics\n"
              "  observability  throughput with tracing on / metrics scraped vs off, on cleave serve clusters\n"
              "  structured  structured-output overhead: half-constrained vs plain batch, TTFT new vs cached schema\n"
              "  fork        n samples as one engine fork vs n independent requests: KV blocks, tokens/s")  # fmt: skip
        return 0 if argv else 2
    if argv[0] == "throughput":
        from shared.bench.throughput import main as run
    elif argv[0] == "serve":
        from shared.bench.serve import main as run
    elif argv[0] == "observability":
        from shared.bench.observability import main as run
    elif argv[0] == "structured":
        from shared.bench.structured import main as run
    elif argv[0] == "fork":
        from shared.bench.fork import main as run
    else:
        print(
            f"unknown benchmark {argv[0]!r}; choose throughput, serve, observability, structured or fork",
            file=sys.stderr,
        )
        return 2
    return run(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
