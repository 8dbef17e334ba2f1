"""The `pdserve` command line: one entry point that wires every part together."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# gRPC's fork handlers can abort a child forked for exec (the embedded redis-server) while
# other threads use gRPC; the child execs at once and needs none of them.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from pdserve.cluster import (
    cli_autoscale,
    cli_bench,
    cli_generate,
    cli_join,
    cli_profile,
    cli_serve,
    cli_status,
    cli_up,
)

DESCRIPTION = """\
pdserve: a disaggregated prefill/decode LLM serving cluster.

  pdserve generate   run the engine offline on a few prompts (greedy with --temperature 0)
  pdserve up         start a cluster: Redis, Ray, prefill/decode workers, router
                     (--head: the head of several hosts)
  pdserve join       add this host (its workers, a router) to a cluster led by `up --head`
  pdserve leave      drain this host's workers and take it out of the cluster
  pdserve status     pools, workers and KV index of a running cluster
  pdserve scale      resize a pool of a running cluster
  pdserve router     one router over the cluster's Redis (a Kubernetes pod's command)
  pdserve worker     one worker that registers in the cluster's Redis (likewise)
  pdserve profile    measure one worker's capacity (the autoscaler sizes pools with it)
  pdserve planner    the autoscaler on its own (Kubernetes, or its decision as metrics)
  pdserve bench      benchmarks: serving load on the router; --offline: engine vs transformers

Run `pdserve COMMAND --help` for the options of a command.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    cli_generate.add_parser(sub)
    cli_bench.add_parser(sub)
    cli_up.add_parser(sub)
    cli_join.add_parsers(sub)
    cli_status.add_parser(sub)
    cli_serve.add_parsers(sub)
    cli_autoscale.add_parser(sub)
    cli_profile.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its options, --help included, are the bench program's
        cli_bench.exec_bench(argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args))
    except ValueError as err:
        # Bad input: say what was wrong and how to fix it, without a traceback.
        print(f"pdserve {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
