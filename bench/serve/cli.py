"""Command-line options of the serving benchmark (``pdserve bench`` wires them in).

Example::

    pdserve bench --dataset-name shared-prefix --num-prompts 200 --request-rate 1,2,4 \
        --goodput ttft:500 tpot:50 --json out.json --plot-dir plots/
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from pdserve.bench.serve.arrivals import parse_rates
from pdserve.bench.serve.config import BACKENDS, BenchConfig, BenchResult
from pdserve.bench.serve.datasets import (
    DATASET_NAMES,
    DatasetSpec,
    MultiTurnSpec,
    RandomSpec,
    SharedPrefixSpec,
    ShareGPTLikeSpec,
)
from pdserve.bench.serve.metrics import parse_goodput
from pdserve.bench.serve.tokens import TokenizerLike, load_tokenizer


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every serving-benchmark option to ``parser``."""
    _add_target_arguments(parser.add_argument_group("server"))
    _add_load_arguments(parser.add_argument_group("load"))
    _add_dataset_arguments(parser.add_argument_group("datasets"))
    _add_output_arguments(parser.add_argument_group("output"))


def _add_target_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--backend", choices=BACKENDS, default="openai", help="default: openai")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="router HTTP address")
    g.add_argument("--grpc-target", default="127.0.0.1:50051", help="router gRPC host:port")
    g.add_argument("--model", default=None, help="model id (default: the server's first)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    g.add_argument(
        "--metrics-url",
        default=None,
        help="Prometheus endpoint read before/after each run (default: BASE_URL/metrics; "
        "'none' to skip)",
    )


def _add_load_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--num-prompts",
        type=int,
        default=100,
        help="requests per run (conversations for multi-turn; default: 100)",
    )
    g.add_argument(
        "--request-rate",
        default="inf",
        help="req/s of Poisson arrivals; a sweep as 1,2,4; inf sends all at once (default: inf)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of arrival gaps; 1 = Poisson, < 1 burstier (default: 1)",
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--warmup", type=int, default=0, help="items sent (and discarded) first")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="KEY:MS",
        help="SLOs in ms, KEY in ttft, tpot, e2el; e.g. ttft:500 tpot:50",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="default: 0 (greedy)")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")


def _add_dataset_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--dataset-name", choices=DATASET_NAMES, default="sharegpt-like")
    g.add_argument(
        "--tokenizer",
        default="auto",
        help="'auto' (default model's if installed, "
        "else none), 'default', 'none' (words rule, text prompts), or a .gguf "
        "file / Hugging Face directory",
    )
    g.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="prompt text file or directory of *.txt (default: bench/data)",
    )
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="fix output lengths")
    g.add_argument(
        "--sharegpt-max-len",
        type=int,
        default=2048,
        help="redraw prompt+output pairs longer than this (default: 2048)",
    )
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [L*(1-r), L*(1+r)] (random and multi-turn)",
    )
    g.add_argument("--prefix-groups", type=int, default=4)
    g.add_argument("--prefix-len", type=int, default=512, help="shared prefix tokens")
    g.add_argument("--question-len", type=int, default=64, help="tokens after the prefix")
    g.add_argument("--prefix-output-len", type=int, default=64)
    g.add_argument("--turns", type=int, default=3, help="user turns per conversation")
    g.add_argument("--turn-input-len", type=int, default=64)
    g.add_argument("--turn-output-len", type=int, default=64)


def _add_output_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--json", type=Path, default=None, help="write all results to this file")
    g.add_argument("--plot-dir", type=Path, default=None, help="write PNG plots here")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def dataset_spec_from_args(args: argparse.Namespace) -> DatasetSpec:
    name = args.dataset_name
    if name == "sharegpt-like":
        return ShareGPTLikeSpec(
            max_total_tokens=args.sharegpt_max_len, fixed_output_tokens=args.sharegpt_output_len
        )
    if name == "random":
        return RandomSpec(args.random_input_len, args.random_output_len, args.random_range_ratio)
    if name == "shared-prefix":
        return SharedPrefixSpec(
            args.prefix_groups, args.prefix_len, args.question_len, args.prefix_output_len
        )
    assert name == "multi-turn", f"argparse let an unknown dataset through: {name!r}"
    return MultiTurnSpec(
        args.turns, args.turn_input_len, args.turn_output_len, args.random_range_ratio
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The benchmark configuration the options describe (loads the tokenizer, if any)."""
    from pdserve.bench.serve.text import load_corpus_paragraphs

    no_metrics = args.metrics_url == "none"
    corpus = tuple(load_corpus_paragraphs(args.corpus)) if args.corpus else None
    if args.corpus and not corpus:
        raise ValueError(f"--corpus {args.corpus}: no text found there")
    return BenchConfig(
        dataset=dataset_spec_from_args(args),
        num_prompts=args.num_prompts,
        request_rates=parse_rates(args.request_rate),
        backend=args.backend,
        base_url=args.base_url,
        grpc_target=args.grpc_target,
        model=args.model,
        max_concurrency=args.max_concurrency,
        warmup=args.warmup,
        seed=args.seed,
        burstiness=args.burstiness,
        slo=parse_goodput(args.goodput),
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        timeout_s=args.timeout,
        scrape_metrics=not no_metrics,
        metrics_url=None if no_metrics else args.metrics_url,
        show_progress=not args.disable_tqdm,
        corpus=corpus,
        tokenizer=_tokenizer(args.tokenizer),
    )


def _tokenizer(spec: str) -> TokenizerLike | None:
    if spec != "auto":
        return load_tokenizer(spec)
    try:
        return load_tokenizer("default")
    except FileNotFoundError as err:
        print(f"no tokenizer ({err}); prompt lengths use the words rule", file=sys.stderr)
        return None


def run_serve_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed options describe; 0 when every run completed requests."""
    from pdserve.bench.serve.report import format_run, write_json
    from pdserve.bench.serve.runner import run_benchmark

    config = config_from_args(args)
    _print_plan(config)

    def show(so_far: BenchResult) -> None:
        print(format_run(so_far, so_far.runs[-1]), flush=True)
        _print_errors(so_far)

    result = run_benchmark(config, on_run=show)
    if result.warmup_failed:
        print(f"warning: {result.warmup_failed} warmup request(s) failed", file=sys.stderr)
    if args.json is not None:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot_dir is not None:
        from pdserve.bench.serve.plots import write_plots

        for path in write_plots(result, args.plot_dir):
            print(f"wrote {path}")
    return 0 if all(run.summary.completed > 0 for run in result.runs) else 1


def _print_errors(result: BenchResult, limit: int = 3) -> None:
    """The distinct reasons of the last run's failures (the first few), so none is silent."""
    errors = list(dict.fromkeys(o.error for o in result.runs[-1].outputs if not o.success))
    for error in errors[:limit]:
        print(f"failed request: {error[:300]}", file=sys.stderr)
    if len(errors) > limit:
        print(f"... and {len(errors) - limit} other error message(s)", file=sys.stderr)


def _print_plan(config: BenchConfig) -> None:
    rates = ", ".join("inf" if math.isinf(r) else f"{r:g}" for r in config.request_rates)
    target = config.grpc_target if config.backend == "grpc" else config.base_url
    exact = "token ids" if config.tokenizer is not None else "text (words rule)"
    print(
        f"pdserve bench: {config.dataset.name} x {config.num_prompts}, rate(s) {rates} req/s, "
        f"max concurrency {config.max_concurrency or 'none'}, prompts as {exact}, "
        f"{config.backend} at {target}",
        flush=True,
    )
