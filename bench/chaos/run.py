"""``python -m pdserve.bench.chaos``: faults under a steady load, one at a time, as a table.

    python -m pdserve.bench.chaos [--faults decode-kill,freeze,...] [--rate 0.5]
                                  [--observe-s 60] [--window-s 10] [--json rows.json]
    python -m pdserve.bench.chaos --soak MINUTES [--rate 0.5]

It starts `pdserve up --prefill 2 --decode 2 --router-processes 2`, runs the load (see
``load.py``) through one fault-free pass over the dataset, whose answers become the
reference, then strikes each fault after a steady stretch and watches ``--observe-s``. Each
row: requests failed (by status), completed streams checked token by token against the
reference (lost, repeated, changed tokens), goodput before / lowest / after and the time
until it is back within 10% (``analysis.py``). The faults on links (link-cut, slow-link)
run after the others, on a cluster of hosts with their own network (``cluster.on_hosts``:
network namespaces on a bridge, which needs root; without it they are listed as not run,
with the reason): `pdserve up --head` on one host, two worker hosts that each join with
`--prefill 1 --decode 1`, the same load sent from this namespace to the head's router,
and a reference pass of their own. ``--soak`` runs no fault: the load for MINUTES, on one
host, watched for growth (``soak.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tqdm import tqdm

from pdserve.bench.chaos.analysis import FaultReport, Slo, report
from pdserve.bench.chaos.cluster import ENV, START_TIMEOUT_S, ChaosCluster, on_hosts, up_args
from pdserve.bench.chaos.faults import FAULT_NAMES, FAULTS, LINK_COMMANDS, Fault, overload
from pdserve.bench.chaos.load import SteadyLoad, chaos_dataset
from pdserve.bench.chaos.soak import SoakReport, print_soak, soak
from pdserve.bench.engine_args import write_rows
from pdserve.bench.netns_hosts import skip_reason
from pdserve.bench.up_process import running_up


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--faults", default=",".join(FAULT_NAMES), help="comma-separated, in order")
    p.add_argument("--rate", type=float, default=0.5, help="requests per second (default 0.5)")
    p.add_argument("--requests", type=int, default=48, help="distinct requests (default 48)")
    p.add_argument(
        "--burst-rate", type=float, default=None,
        help="the overload burst's requests per second (default 10x --rate); set it to 10x "
        "what the cluster sustains",
    )  # fmt: skip
    p.add_argument("--observe-s", type=float, default=60.0, help="watch after a fault")
    p.add_argument("--window-s", type=float, default=10.0, help="goodput window")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=250.0)
    p.add_argument(
        "--shed-ttft-factor", type=float, default=3.0,
        help="the router refuses a request that would queue past this many TTFT objectives",
    )  # fmt: skip
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per worker")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument(
        "--soak", type=float, default=None, metavar="MINUTES",
        help="no faults: the steady load for MINUTES, watching memory, descriptors, threads, "
        "KV blocks and Redis keys",
    )  # fmt: skip
    p.add_argument("--sample-s", type=float, default=30.0, help="soak sampling period")
    args = p.parse_args(argv)
    unknown = set(args.faults.split(",")) - set(FAULT_NAMES)
    if unknown:
        p.error(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULT_NAMES)}")
    return args


async def run_faults(
    cluster: ChaosCluster, faults: Sequence[Fault], args: argparse.Namespace
) -> list[FaultReport]:
    dataset = chaos_dataset(args.requests)
    load = SteadyLoad(cluster.grpc_address, dataset, args.rate)
    running = asyncio.create_task(load.run())
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    try:
        reference, lead_s = await _reference_pass(load, len(dataset), args.rate, slo)
        reports = []
        for fault in tqdm(faults, desc="faults", unit="fault"):
            await asyncio.sleep(args.window_s + lead_s)  # a steady stretch: "before"
            fault_s = time.monotonic()
            target = await fault.strike(cluster, load)
            print(f"{fault.name}: struck {target}", flush=True)
            await asyncio.sleep(args.observe_s)
            settled_s = time.monotonic() - lead_s  # requests sent later may still run
            outcomes = load.outcomes
            window = (fault_s, settled_s, args.window_s, lead_s)
            reports.append(report(fault.name, outcomes, reference, slo, *window))
    finally:
        load.stop()
        await running
    return reports


async def _reference_pass(
    load: SteadyLoad, num_requests: int, rate: float, slo: Slo
) -> tuple[dict[int, tuple[int, ...]], float]:
    """One fault-free pass over the dataset: its tokens, and the longest request (s)."""
    keys = set(range(num_requests))
    while True:
        await asyncio.sleep(1.0)
        done = {o.key: o for o in load.outcomes if o.key in keys}
        if len(done) == num_requests:
            break
    failed = [o for o in done.values() if not o.ok]
    if failed:
        raise RuntimeError(f"the fault-free pass failed {len(failed)} requests: {failed[:3]}")
    met = sum(slo.met_by(o) for o in done.values()) / num_requests
    print(f"fault-free pass: {num_requests} requests at {rate}/s, {met:.0%} within the SLO")
    return {k: o.tokens for k, o in done.items()}, max(o.done_s - o.sent_s for o in done.values())


async def run_soak(cluster: ChaosCluster, args: argparse.Namespace) -> SoakReport:
    """The load for ``--soak`` minutes. Requests the router refuses (its admission follows
    the SLO, which a busy machine misses) are counted, not fatal; every completed stream of
    a request must equal its first completed stream (all are greedy or seeded)."""
    dataset = chaos_dataset(args.requests)
    load = SteadyLoad(cluster.grpc_address, dataset, args.rate)
    running = asyncio.create_task(load.run())
    try:
        result = await soak(cluster, load, args.soak, args.sample_s)
    finally:
        load.stop()
        await running
    first: dict[int, tuple[int, ...]] = {}
    for outcome in sorted((o for o in load.outcomes if o.ok), key=lambda o: o.sent_s):
        first.setdefault(outcome.key, outcome.tokens)
    wrong = sum(o.ok and o.tokens != first[o.key] for o in load.outcomes)
    return dataclasses.replace(result, inexact_streams=wrong)


def format_table(
    reports: Sequence[FaultReport], faults: Sequence[Fault], not_run: Mapping[str, str]
) -> str:
    """The markdown table: a row per fault in ``faults``' order, ``not_run`` ones (name ->
    why) with their reason."""
    by_fault = {r.fault: r for r in reports}
    lines = [
        "| fault | requests | failed (status) | completed | lost / repeated / changed tokens "
        "| retried | answered within the SLO | goodput before / lowest / after (req/s) "
        "| back within 10% after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in faults:
        r = by_fault.get(f.name)
        if r is None:
            lines.append(f"| {f.what} | not run: {not_run[f.name]} | | | | | | | |")
            continue
        failed = ", ".join(f"{n} {s}" for s, n in sorted(r.failed.items())) or "0"
        e = r.errors
        back = "not within the run" if r.recovery_s is None else f"{r.recovery_s:.0f} s"
        lines.append(
            f"| {f.what} | {r.requests} | {failed} | {r.completed} "
            f"| {e.lost} / {e.repeated} / {e.changed} | {r.retried} | {r.admitted_attainment:.0%} "
            f"| {r.goodput_before:.2f} / {r.goodput_lowest:.2f} / {r.goodput_after:.2f} | {back} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    burst_rate = 10 * args.rate if args.burst_rate is None else args.burst_rate
    faults = {f.name: f for f in (*FAULTS, overload(burst_rate))}
    chosen = [faults[name] for name in args.faults.split(",")]
    on_one_host = [f for f in chosen if not f.needs_hosts]
    on_worker_hosts = [f for f in chosen if f.needs_hosts]
    hosts_missing = skip_reason(LINK_COMMANDS) if on_worker_hosts else None
    not_run = {f.name: hosts_missing for f in on_worker_hosts if hosts_missing is not None}
    if hosts_missing is not None:
        print(f"the faults on links are not run: {hosts_missing}", flush=True)
    reports: list[FaultReport] = []
    slo_ms = (args.slo_ttft_ms, args.slo_tpot_ms)
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as tmp:
        if on_one_host or args.soak is not None:
            shed = args.shed_ttft_factor
            cli = up_args(args.prefill, args.decode, 2, args.num_blocks, slo_ms, shed)
            with running_up(Path(tmp), cli, ENV, START_TIMEOUT_S) as up:
                if args.soak is not None:
                    soaked = asyncio.run(run_soak(ChaosCluster(up), args))
                    print_soak(soaked)
                    return 0 if soaked.clean else 1
                reports += asyncio.run(run_faults(ChaosCluster(up), on_one_host, args))
        if on_worker_hosts and not not_run:
            head_flags = up_args(0, 0, 1, args.num_blocks, slo_ms, args.shed_ttft_factor)
            with on_hosts(Path(tmp), head_flags, args.num_blocks) as cluster:
                reports += asyncio.run(run_faults(cluster, on_worker_hosts, args))
    print(format_table(reports, chosen, not_run))
    write_rows(reports, args.json)
    bad = [r.fault for r in reports if r.errors.total or r.inexact_streams]
    if bad:
        print(f"completed streams with wrong tokens after: {', '.join(bad)}")
    return 1 if bad else 0
