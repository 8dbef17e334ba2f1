"""`pdserve bench`: hands its arguments to the benchmark program that bench/ owns.

The product never imports ``bench/``: this command replaces the process with
``python -m pdserve.bench`` (the same interpreter), which parses the arguments itself.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

BENCH_COMMAND = (sys.executable, "-m", "pdserve.bench")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: serving load against the router, or --offline engine throughput",
        description=__doc__ + "\nSee `pdserve bench --help` for its options.",
        add_help=False,  # --help goes to the benchmark program, which knows the options
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="ARGS")


def exec_bench(bench_args: Sequence[str]) -> NoReturn:
    """Replace this process with the benchmark program, given ``bench_args``."""
    os.execv(BENCH_COMMAND[0], [*BENCH_COMMAND, *bench_args])
