"""`pdserve bench`: load the router like users do, or (`--offline`) the engine alone.

`pdserve bench --offline [ARGS]` hands ARGS to ``pdserve.bench.engine_throughput`` (pdserve's
engine vs transformers on one fixed workload); without ``--offline`` it is the serving
benchmark of ``pdserve.bench.serve`` (datasets, Poisson arrivals, TTFT/TPOT/ITL percentiles,
goodput). The same program runs as ``python -m pdserve.bench`` and ``pdserve-bench``; the
``pdserve`` CLI execs it, so the product imports nothing of ``bench/``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pdserve.bench.serve.cli import add_serve_arguments, run_serve_bench


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--offline",
        nargs=argparse.REMAINDER,
        default=None,
        metavar="ARGS",
        help="run the offline engine throughput benchmark with ARGS "
        "(see `python -m pdserve.bench.engine_throughput --help`)",
    )
    add_serve_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.offline is not None:
            from pdserve.bench.engine_throughput import main as offline_main

            offline_main(args.offline)
            return 0
        return run_serve_bench(args)
    except ValueError as err:
        print(f"pdserve bench: error: {err}", file=sys.stderr)
        return 2
