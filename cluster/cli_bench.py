"""`pdserve bench`: load the router like users do, or (`--offline`) the engine alone.

`pdserve bench --offline [ARGS]` hands ARGS to ``pdserve.bench.engine_throughput`` (pdserve's engine
vs transformers on one fixed workload); without ``--offline`` it is the serving benchmark of
``pdserve.bench.serve`` (datasets, Poisson arrivals, TTFT/TPOT/ITL percentiles, goodput).
"""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: serving load against the router, or --offline engine throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--offline",
        nargs=argparse.REMAINDER,
        default=None,
        metavar="ARGS",
        help="run the offline engine throughput benchmark with ARGS "
        "(see `python -m pdserve.bench.engine_throughput --help`)",
    )
    from pdserve.bench.serve.cli import add_serve_arguments

    add_serve_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.offline is not None:
        from pdserve.bench.engine_throughput import main

        main(args.offline)
        return 0
    from pdserve.bench.serve.cli import run_serve_bench

    return run_serve_bench(args)
