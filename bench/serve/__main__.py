"""``python -m pdserve.bench.serve ...``: the serving benchmark without the ``pdserve`` CLI."""

from __future__ import annotations

import argparse
import sys

from pdserve.bench.serve.cli import add_serve_arguments, run_serve_bench


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.bench.serve",
        description="Serving benchmark of an OpenAI/gRPC router.",
    )
    add_serve_arguments(parser)
    args = parser.parse_args()
    try:
        return run_serve_bench(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
