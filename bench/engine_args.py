"""The command line the single-engine benchmarks share: the model and its dtype, ``--json`` for
the rows and ``--quick`` for a smoke run."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from typing import Any


def engine_bench_parser(module: str, doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    """The parser of ``python -m pdserve.bench.<module>``, its docstring as the help."""
    parser = argparse.ArgumentParser(
        prog=f"python -m pdserve.bench.{module}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {quick_help}")
    return parser


def write_rows(rows: Sequence[Any], path: str | None) -> None:
    """The rows (dataclasses) as a JSON list, when ``path`` is given."""
    if path:
        with open(path, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=2)
