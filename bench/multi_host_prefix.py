"""The shared-prefix workload on 4 prefill workers over 2 hosts: routing policies side by side.

The workload, its flags and the table are those of ``python -m pdserve.bench.goodput_sweep
prefix`` (8 groups of a 1,024-token prefix, 64-token questions, Poisson arrivals through
``pdserve.bench.serve``); the cluster is spread over hosts (network namespaces on one bridge,
``pdserve.bench.netns_hosts``; needs root), started with the commands a user runs:

    head  `pdserve up --head --policy P`: Redis, Ray head, the router; no workers
    h1    `pdserve join --prefill 2 --decode 1`
    h2    `pdserve join --prefill 2`

A fresh cluster per policy (in ``--policies`` order), so each starts with empty caches and
sees the same seeded requests. Prefix hits: the router's prompt and hit token counters.

    sudo .venv/bin/python -m pdserve.bench.multi_host_prefix [goodput_sweep prefix flags]
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from pdserve.bench.goodput_sweep import build_parser, prefix_config
from pdserve.bench.netns_cluster import join, joined, start_head
from pdserve.bench.netns_hosts import lan, skip_reason
from pdserve.bench.serve.compare import prefix_table
from pdserve.bench.serve.config import BenchConfig, BenchResult
from pdserve.bench.serve.report import format_run
from pdserve.bench.serve.runner import run_benchmark
from pdserve.router.policies import normalize_policy_name

HOSTS = ("head", "h1", "h2")


def run_policy(policy: str, config: BenchConfig, num_blocks: int) -> BenchResult:
    """One fresh cluster routed by ``policy``, the workload through its router."""
    blocks = ("--num-blocks", str(num_blocks))
    with tempfile.TemporaryDirectory(prefix="pdserve-prefixbench-") as tmp, lan(HOSTS) as net:
        directory = Path(tmp)
        head = start_head(net, directory, "--policy", policy, *blocks)
        join(net, directory, head, "h1", "--prefill", "2", "--decode", "1", *blocks)
        join(net, directory, head, "h2", "--prefill", "2", *blocks)
        joined(directory, ("h1", "h2"))
        print(f"== {policy}: 4 prefill workers on h1, h2; 1 decode on h1", flush=True)
        result = run_benchmark(replace(config, base_url=head["http"], metrics_url=head["metrics"]))
    print(format_run(result, result.runs[-1]), flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    reason = skip_reason()
    if reason is not None:
        raise SystemExit(f"pdserve.bench.multi_host_prefix: {reason}")
    parser = build_parser()
    parser.prog = "python -m pdserve.bench.multi_host_prefix"
    args = parser.parse_args(["prefix", *(argv or [])])
    config = prefix_config(args)
    series = {
        name: run_policy(name, config, args.num_blocks)
        for name in (normalize_policy_name(p) for p in args.policies.split(","))
    }
    print(prefix_table(series))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
