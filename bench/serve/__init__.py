"""``pdserve bench`` serving load generator, in the manner of ``vllm bench serve``.

Library use::

    from pdserve.bench.serve import BenchConfig, RandomSpec, run_benchmark
    result = run_benchmark(BenchConfig(dataset=RandomSpec(128, 32), num_prompts=50,
                                       request_rates=(2.0,), base_url="http://127.0.0.1:8000"))
    print(result.runs[0].summary.ttft.p99_ms)

The CLI: :func:`add_serve_arguments` and :func:`run_serve_bench` (see README.md).
"""

from pdserve.bench.serve.cli import add_serve_arguments, config_from_args, run_serve_bench
from pdserve.bench.serve.config import BenchConfig, BenchResult, RateResult
from pdserve.bench.serve.datasets import (
    BenchRequest,
    Conversation,
    MultiTurnSpec,
    RandomSpec,
    SharedPrefixSpec,
    ShareGPTLikeSpec,
    build_dataset,
)
from pdserve.bench.serve.metrics import SLO, Summary
from pdserve.bench.serve.runner import arun_benchmark, run_benchmark

__all__ = [
    "SLO",
    "BenchConfig",
    "BenchRequest",
    "BenchResult",
    "Conversation",
    "MultiTurnSpec",
    "RandomSpec",
    "RateResult",
    "ShareGPTLikeSpec",
    "SharedPrefixSpec",
    "Summary",
    "add_serve_arguments",
    "arun_benchmark",
    "build_dataset",
    "config_from_args",
    "run_benchmark",
    "run_serve_bench",
]
