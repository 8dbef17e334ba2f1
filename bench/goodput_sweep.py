"""Two side-by-side serving comparisons on local clusters, for docs/benchmarks.md.

``goodput``: goodput against the offered request rate under a TTFT and an ITL target, for
1 prefill + 1 decode worker (each pinned to its own core) versus 2 colocated workers (one per
core, the same 2 cores) -- DistServe's comparison in miniature::

    python -m pdserve.bench.goodput_sweep goodput --rates 0.5,1,1.5,2,3 --slo-ttft-ms 1000 \
        --slo-itl-ms 75 --cores 0,1

``prefix``: the shared-prefix workload (8 groups x 1,024-token prefix + 64-token questions)
on 2 prefill workers + 1 decode worker, once per routing policy::

    python -m pdserve.bench.goodput_sweep prefix --policies round_robin,prefix_aware

Each setup gets a fresh `pdserve up` (``bench/up_process.py`` launches it as the cluster
tests do: local Ray, embedded Redis, the real model, one torch thread per worker), so every
setup starts cold and sees the same seeded requests; on stop, any process it left behind is
killed and named. Workers are pinned with `pdserve up --cpu-affinity`; the
router, Ray's daemons, Redis and this client are not pinned (the same for every setup).
Requests go through ``pdserve.bench.serve`` (the code behind `pdserve bench`); its table prints
after every run. Out: a Markdown table on stdout (``--table`` also
writes it), one PNG (``--plot``) and, with ``--json``, every request of every run.

Goodput is DistServe's: completed requests per second meeting both targets, where the ITL
target applies to each request's mean inter-token latency (its TPOT), as ``--goodput
ttft:MS tpot:MS`` does in `pdserve bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pdserve.bench.serve.arrivals import parse_rates
from pdserve.bench.serve.compare import (
    Series,
    goodput_table,
    plot_goodput_vs_rate,
    plot_prefix_routing,
    prefix_table,
)
from pdserve.bench.serve.config import BenchConfig, BenchResult
from pdserve.bench.serve.datasets import RandomSpec, SharedPrefixSpec
from pdserve.bench.serve.metrics import SLO
from pdserve.bench.serve.report import format_run, result_to_dict
from pdserve.bench.serve.runner import run_benchmark
from pdserve.bench.serve.tokens import load_tokenizer
from pdserve.bench.up_process import start_up

DOCS_IMG = Path(__file__).resolve().parents[1] / "docs" / "img"
GOODPUT_SETUPS = ("disagg", "colocated")
WORKER_ENV = {"PDSERVE_TORCH_THREADS": "1"}  # one thread for the one core a worker is pinned to


@dataclass(slots=True, frozen=True)
class ClusterSetup:
    """One `pdserve up` configuration: its flags, and the core of each worker, by role, in
    worker-id order (``{"prefill": (0,), "decode": (1,)}``; empty: nothing pinned)."""

    label: str
    up_args: tuple[str, ...]
    cores: dict[str, tuple[int, ...]] = field(default_factory=dict)


def goodput_setups(cores: tuple[int, int], wanted: Sequence[str]) -> list[ClusterSetup]:
    """The disaggregated and the colocated cluster on the same two cores."""
    a, b = cores
    setups = {
        "disagg": ClusterSetup(
            "1 prefill + 1 decode", ("--prefill", "1", "--decode", "1"),
            {"prefill": (a,), "decode": (b,)},
        ),
        "colocated": ClusterSetup("2 colocated", ("--colocated", "2"), {"colocated": (a, b)}),
    }  # fmt: skip
    unknown = set(wanted) - set(setups)
    if unknown:
        raise ValueError(f"--setups: unknown {sorted(unknown)}; choose from {GOODPUT_SETUPS}")
    return [setups[name] for name in wanted]


def prefix_setups(policies: Sequence[str]) -> list[ClusterSetup]:
    """2 prefill + 1 decode workers, routed by each policy in turn (workers not pinned)."""
    from pdserve.router.policies import normalize_policy_name  # pure module: no grpc, no torch

    names = [normalize_policy_name(p) for p in policies]
    return [
        ClusterSetup(name, ("--prefill", "2", "--decode", "1", "--policy", name)) for name in names
    ]


def affinity_flags(cores: dict[str, tuple[int, ...]]) -> tuple[str, ...]:
    """`pdserve up --cpu-affinity` (cluster/cpu_affinity.py) for ``{"prefill": (0,), ...}``."""
    if not cores:
        return ()
    spec = ";".join(f"{role}={','.join(map(str, c))}" for role, c in cores.items())
    return ("--cpu-affinity", spec)


def check_pinned(workers: Sequence[dict[str, Any]], cores: dict[str, tuple[int, ...]]) -> None:
    """Every worker of a pinned pool (rows of `pdserve status --json`) runs on its one core."""
    for role, role_cores in cores.items():
        rows = sorted((w for w in workers if w["role"] == role), key=lambda w: w["worker_id"])
        if len(rows) != len(role_cores):
            raise ValueError(f"{len(rows)} {role} worker(s) up but cores given: {role_cores}")
        for row, core in zip(rows, role_cores, strict=True):
            allowed = os.sched_getaffinity(int(row["pid"]))
            if allowed != {core}:
                raise RuntimeError(f"{row['worker_id']} should run on core {core}: {allowed}")
            print(f"{row['worker_id']} (pid {row['pid']}) runs on core {core}", flush=True)


def run_setup(setup: ClusterSetup, config: BenchConfig, work_dir: Path) -> BenchResult:
    """Start the cluster, pin its workers, run the benchmark against it, stop it."""
    print(f"== {setup.label}: pdserve up {' '.join(setup.up_args)}", flush=True)
    up = start_up(work_dir, (*setup.up_args, *affinity_flags(setup.cores)), WORKER_ENV)
    try:
        up.wait_serving()
        check_pinned(up.status()["workers"], setup.cores)

        def show(so_far: BenchResult) -> None:
            print(format_run(so_far, so_far.runs[-1]), flush=True)

        return run_benchmark(replace(config, base_url=up.http_url), on_run=show)
    finally:
        code = up.stop()
        print(f"== {setup.label}: stopped (exit {code}); log {up.log_path}", flush=True)
        if up.orphans_killed:
            print(f"== {setup.label}: killed leftover processes: {up.orphans_killed}", flush=True)


def run_setups(
    setups: Sequence[ClusterSetup], config: BenchConfig, args: argparse.Namespace
) -> Series:
    """Every setup in turn, with ``--num-blocks`` per worker; label -> result."""
    series: dict[str, BenchResult] = {}
    logs = Path(tempfile.mkdtemp(prefix="pdserve-goodput-", dir=args.work_dir))  # kept
    for index, setup in enumerate(setups):
        work_dir = logs / str(index)
        work_dir.mkdir()
        flags = (*setup.up_args, "--num-blocks", str(args.num_blocks), *args.up_arg)
        series[setup.label] = run_setup(replace(setup, up_args=flags), config, work_dir)
    return series


def goodput_config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        dataset=RandomSpec(args.input_len, args.output_len, args.range_ratio),
        num_prompts=args.num_prompts,
        request_rates=parse_rates(args.rates),
        warmup=args.warmup,
        seed=args.seed,
        slo=SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_itl_ms),
        ignore_eos=True,  # every request generates exactly --output-len tokens
        show_progress=not args.disable_tqdm,
        tokenizer=load_tokenizer("default"),
    )


def prefix_config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        dataset=SharedPrefixSpec(
            args.prefix_groups, args.prefix_len, args.question_len, args.output_len
        ),
        num_prompts=args.num_prompts,
        request_rates=(args.rate,),
        max_concurrency=args.max_concurrency,
        warmup=args.warmup,
        seed=args.seed,
        ignore_eos=True,
        show_progress=not args.disable_tqdm,
        tokenizer=load_tokenizer("default"),
    )


def run_goodput(args: argparse.Namespace) -> int:
    cores = _two_cores(args.cores)
    setups = goodput_setups(cores, [s.strip() for s in args.setups.split(",")])
    series = run_setups(setups, goodput_config(args), args)
    table = goodput_table(series)
    return _finish(args, series, table, plot_goodput_vs_rate(series, args.plot))


def run_prefix(args: argparse.Namespace) -> int:
    setups = prefix_setups(args.policies.split(","))
    series = run_setups(setups, prefix_config(args), args)
    table = prefix_table(series)
    return _finish(args, series, table, plot_prefix_routing(series, args.plot))


def _finish(args: argparse.Namespace, series: Series, table: str, plot: Path) -> int:
    print(table)
    print(f"wrote {plot}")
    if args.table is not None:
        args.table.write_text(table + "\n")
        print(f"wrote {args.table}")
    if args.json is not None:
        record = {label: result_to_dict(result) for label, result in series.items()}
        args.json.write_text(json.dumps({"kind": args.command, "setups": record}, indent=2))
        print(f"wrote {args.json}")
    return 0 if all(r.summary.completed for res in series.values() for r in res.runs) else 1


def _two_cores(text: str) -> tuple[int, int]:
    try:
        a, b = (int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--cores wants two core numbers like 0,1, got {text!r}") from None
    count = os.cpu_count() or 1
    if not (0 <= a < count and 0 <= b < count):
        raise ValueError(f"--cores {text}: this machine has cores 0..{count - 1}")
    return a, b


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_goodput_flags, _prefix_flags):
        _common_flags(add(sub))
    return parser


def _goodput_flags(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    g = sub.add_parser("goodput", help="goodput vs rate: 1P+1D pinned vs 2 colocated")
    g.add_argument("--rates", default="0.5,1,1.5,2,3", help="offered req/s, a list")
    g.add_argument("--num-prompts", type=int, default=40, help="requests per rate")
    g.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    g.add_argument("--output-len", type=int, default=64, help="generated tokens")
    g.add_argument("--range-ratio", type=float, default=0.25, help="length spread, 0..1")
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="TTFT target")
    itl_help = "target for each request's mean inter-token latency (TPOT)"
    g.add_argument("--slo-itl-ms", type=float, default=75.0, help=itl_help)
    g.add_argument("--cores", default="0,1", help="prefill,decode cores (colocated: one each)")
    g.add_argument("--setups", default=",".join(GOODPUT_SETUPS), help="which setups to run")
    g.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per worker")
    g.add_argument("--plot", type=Path, default=DOCS_IMG / "goodput_vs_rate.png")
    g.set_defaults(run=run_goodput)
    return g


def _prefix_flags(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = sub.add_parser("prefix", help="shared-prefix workload: routing policies side by side")
    baseline_help = "the first is the baseline of the ratios"
    p.add_argument("--policies", default="round_robin,prefix_aware", help=baseline_help)
    p.add_argument("--prefix-groups", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1024, help="shared prefix tokens")
    p.add_argument("--question-len", type=int, default=64, help="tokens after the prefix")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--rate", type=float, default=0.5, help="offered req/s")
    in_flight_help = "requests in flight (decode KV must hold this many)"
    p.add_argument("--max-concurrency", type=int, default=4, help=in_flight_help)
    blocks_help = "KV blocks per worker: 384 holds ~5 of 8 1,024-token prefixes"
    p.add_argument("--num-blocks", type=int, default=384, help=blocks_help)
    p.add_argument("--plot", type=Path, default=DOCS_IMG / "shared_prefix_routing.png")
    p.set_defaults(run=run_prefix)
    return p


def _common_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--warmup", type=int, default=2, help="requests sent first, discarded")
    s.add_argument("--seed", type=int, default=0)
    up_help = "extra `pdserve up` flag (repeat; e.g. --up-arg=--dtype=bfloat16)"
    s.add_argument("--up-arg", action="append", default=[], metavar="ARG", help=up_help)
    s.add_argument("--table", type=Path, default=None, help="also write the table here")
    s.add_argument("--json", type=Path, default=None, help="every run and request")
    logs_help = "where cluster logs go (default: /tmp)"
    s.add_argument("--work-dir", type=Path, default=None, help=logs_help)
    s.add_argument("--disable-tqdm", action="store_true")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    raise SystemExit(main())
