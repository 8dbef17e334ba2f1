"""Router overhead on loopback: added latency, sustained requests/s and CPU per request.

    python -m pdserve.bench.router_overhead [--mode colocated|disagg] [--requests 4000]
                                    [--concurrency 64] [--clients 2] [--router-processes 1]
                                    [--loop auto|uvloop|asyncio] [--latency-requests 300]
                                    [--max-tokens 4] [--locality] [--json out.json]

Processes: stub worker(s) (``tests/integration/stub_worker.py``: a real gRPC server that
answers at once, no model), the router (gRPC Inference server, token-id prompts;
``--router-processes`` of them on one port, router/processes.py) and ``--clients`` load
client processes (bench/router_load.py). Latency: requests one at a time from this
process, to the stub directly (the same RPCs the router makes: Generate; or ReserveKV,
Prefill, Decode) and through the router; added p50 = router p50 - direct p50. Throughput:
``--requests`` with ``--concurrency`` in flight, split over the clients, direct and through
the router. CPU per request is read from /proc for every process tree over the throughput
run: it does not depend on how busy the machine was, unlike req/s, which on a small
machine is bounded by the client and the stubs sharing the router's cores.

``--locality`` routes as ``pdserve up`` does: each prompt's block hashes are computed and
looked up in a Redis locality index (an embedded redis-server started for the run, empty,
so every lookup is a full round trip that finds nothing) and in the router's own placement
memory. Without it the router has no index and skips both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from pdserve.bench.router_load import (
    LoadResult,
    LoadShape,
    cpu_used_s,
    latencies_ms,
    make_call,
    run_clients,
    spawn_module,
    tree_cpu_s,
)
from pdserve.router.config import RouterConfig
from pdserve.router.event_loop import LOOP_KINDS, LoopKind, resolve, run
from pdserve.router.service import RouterService

READY = "router ready:"  # what the router process prints once every process serves


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- the router process(es) ----------------------------------------------------------------


class BenchTokenizer:
    """A FAKE tokenizer: the benchmark sends token ids, so text never needs real tokens."""

    eos_token_id = 0
    max_context_tokens = 4096
    model_id = "bench-model"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


async def bench_router(
    workers: Sequence[str], redis_url: str | None, config: RouterConfig
) -> RouterService:
    """The router with its default policy, in front of ``id=role@host:port`` workers; with
    ``redis_url``, also a Redis locality index and the engine's block hasher."""
    from pdserve.proto.workers import WorkerInfo, WorkerRole
    from pdserve.router.service import start_router
    from pdserve.router.state.directory import StaticWorkerDirectory

    infos = []
    for spec in workers:
        worker_id, rest = spec.split("=", 1)
        role, address = rest.split("@", 1)
        infos.append(WorkerInfo(worker_id, WorkerRole(role), address))
    directory = StaticWorkerDirectory(infos)
    if redis_url is None:
        return await start_router(config, BenchTokenizer(), directory)
    from pdserve.cluster.locality_index import LocalityIndex
    from pdserve.cluster.router_start import RedisRouterSpec
    from pdserve.cluster.router_wiring import RedisLocality
    from pdserve.proto.redis_keys import RedisKeys
    from pdserve.router.state.batched_lookups import BatchedLookups
    from pdserve.router.state.locality import engine_prompt_hasher

    client = RedisRouterSpec(redis_url, "pdserve-bench", 10.0, BenchTokenizer.model_id).client()
    locality = RedisLocality(LocalityIndex(client, RedisKeys("pdserve-bench")))
    hasher = engine_prompt_hasher(BenchTokenizer.model_id, config.block_size)
    lookups = BatchedLookups(locality)  # as cluster/router_start.py wires it
    return await start_router(config, BenchTokenizer(), directory, lookups, hasher)


async def serve_router(
    workers: Sequence[str], port: int, processes: int, loop: LoopKind, redis_url: str | None
) -> None:
    from pdserve.router.processes import start_router_processes

    config = RouterConfig(grpc_port=port, http_port=0, max_concurrent_requests=100_000)
    factory = partial(bench_router, tuple(workers), redis_url)
    group = await start_router_processes(config, factory, processes, loop)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(f"{READY} {processes} process(es) {group.pids} on port {port}", flush=True)
    await stop.wait()  # a clean exit on SIGTERM (lets a profiler write its output)
    await group.stop(grace_s=None)


# --- measuring -----------------------------------------------------------------------------


def percentiles(samples: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(samples, n=100)
    return {"p50": statistics.median(samples), "p90": cuts[89], "p99": cuts[98]}


async def wait_ready(address: str, timeout_s: float = 60.0) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)


async def measure_latency(
    args: argparse.Namespace, direct: list[str], routed: list[str]
) -> dict[str, Any]:
    for address in [*direct[1:], routed[1]]:
        await wait_ready(address)
    direct_call, direct_channels = make_call(direct, args.max_tokens)
    router_call, router_channels = make_call(routed, args.max_tokens)
    got = (await router_call(), await direct_call())
    assert got == (args.max_tokens, args.max_tokens), f"router, stub sent {got} tokens"
    direct_ms = percentiles(await latencies_ms(direct_call, args.latency_requests))
    router_ms = percentiles(await latencies_ms(router_call, args.latency_requests))
    for channel in [*direct_channels, *router_channels]:
        await channel.close()
    return {"direct_ms": direct_ms, "router_ms": router_ms}


def measure_load(
    args: argparse.Namespace, target: list[str], trees: dict[str, list[int]]
) -> tuple[LoadResult, dict[str, Any]]:
    """Throughput against ``target``; CPU ms per request of each process tree in ``trees``
    (and, for the router, of each of its processes)."""
    before: dict[str, dict[int, float]] = {}

    def sample() -> None:
        before.update({name: tree_cpu_s(pids) for name, pids in trees.items()})

    shape = LoadShape(
        args.requests, args.concurrency, args.clients, args.connections, args.max_tokens, args.loop
    )
    load = run_clients(target, shape, sample)
    after = {name: tree_cpu_s(pids) for name, pids in trees.items()}
    cpu_ms: dict[str, Any] = {
        name: cpu_used_s(before[name], after[name]) * 1e3 / load.requests for name in trees
    }
    cpu_ms["clients"] = load.client_cpu_s * 1e3 / load.requests
    if "router" in trees:  # how evenly the kernel spread the connections
        used = {p: after["router"][p] - before["router"].get(p, 0.0) for p in after["router"]}
        cpu_ms["router_by_process"] = [v * 1e3 / load.requests for v in used.values() if v > 0]
    return load, cpu_ms


def measure(
    args: argparse.Namespace, stubs: dict[str, str], router: str, pids: dict[str, list[int]]
) -> dict[str, Any]:
    addresses = list(stubs.values())
    direct = ["colocated" if args.mode == "colocated" else "disagg", *addresses]
    routed = ["router", router]
    result: dict[str, Any] = {k: getattr(args, k) for k in _ARGS}
    result["loop"] = resolve(args.loop)
    result |= run(measure_latency(args, direct, routed), args.loop)
    direct_load, direct_cpu = measure_load(args, direct, {"stubs": pids["stubs"]})
    router_load, router_cpu = measure_load(args, routed, pids)
    return result | {
        "added_p50_ms": result["router_ms"]["p50"] - result["direct_ms"]["p50"],
        "direct_rps": direct_load.rps,
        "router_rps": router_load.rps,
        "cpus": os.cpu_count(),
        "direct_cpu_ms_per_request": direct_cpu,
        "router_cpu_ms_per_request": router_cpu,
        "router_rps_per_core": 1e3 / router_cpu["router"] if router_cpu["router"] > 0 else None,
    }


_ARGS = (
    "mode",
    "max_tokens",
    "requests",
    "concurrency",
    "clients",
    "connections",
    "router_processes",
    "latency_requests",
    "locality",
)


def start_processes(
    args: argparse.Namespace, redis_url: str | None
) -> tuple[dict[str, str], str, list[subprocess.Popen[bytes]]]:
    roles = {"w0": "colocated"} if args.mode == "colocated" else {"p0": "prefill", "d0": "decode"}
    stubs = {name: f"127.0.0.1:{free_port()}" for name in roles}
    router = f"127.0.0.1:{free_port()}"
    procs = [
        spawn_module(
            "tests.integration.stub_worker",
            [
                "--port",
                address.rsplit(":", 1)[1],
                "--role",
                roles[name],
                "--worker-id",
                name,
                "--loop",
                args.loop,
            ],
        )
        for name, address in stubs.items()
    ]
    specs = [f"{name}={roles[name]}@{address}" for name, address in stubs.items()]
    serve = ["--router-processes", str(args.router_processes), "--loop", args.loop]
    if redis_url is not None:
        serve += ["--redis-url", redis_url]
    procs.append(
        spawn_module(
            "pdserve.bench.router_overhead",
            [*serve, "--serve-router", router, *specs],
            stdout=subprocess.PIPE,
        )
    )
    return stubs, router, procs


def wait_router(proc: subprocess.Popen[bytes]) -> None:
    """Until the router process says all its processes serve (it exits on failure)."""
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode().strip()
        print(line, flush=True)
        if line.startswith(READY):
            return
    raise RuntimeError(f"the router process exited (code {proc.wait()}) before it was ready")


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    if not args.locality:
        return run_bench_with(args, None)
    from pdserve.cluster.redis_server import RedisServer

    with RedisServer() as redis_server:
        return run_bench_with(args, redis_server.url)


def run_bench_with(args: argparse.Namespace, redis_url: str | None) -> dict[str, Any]:
    stubs, router, procs = start_processes(args, redis_url)
    try:
        wait_router(procs[-1])
        pids = {"router": [procs[-1].pid], "stubs": [p.pid for p in procs[:-1]]}
        return measure(args, stubs, router, pids)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def report(result: dict[str, Any]) -> str:
    d, r = result["direct_ms"], result["router_ms"]
    dc, rc = result["direct_cpu_ms_per_request"], result["router_cpu_ms_per_request"]
    all_ms = rc["router"] + rc["stubs"] + rc["clients"]
    cpus = result["cpus"]
    return "\n".join(
        [
            f"router overhead ({result['mode']}, {result['max_tokens']} tokens/request, "
            f"{result['router_processes']} router process(es), event loop {result['loop']}, "
            f"{cpus} CPUs shared by clients, router and stubs"
            f"{', Redis locality index' if result['locality'] else ', no locality index'})",
            f"  latency, 1 in flight, {result['latency_requests']} requests (ms):",
            f"    direct to stub   p50 {d['p50']:.3f}  p90 {d['p90']:.3f}  p99 {d['p99']:.3f}",
            f"    through router   p50 {r['p50']:.3f}  p90 {r['p90']:.3f}  p99 {r['p99']:.3f}",
            f"    added p50        {result['added_p50_ms']:.3f} ms   (target < 2 ms)",
            f"  throughput, {result['requests']} requests, {result['concurrency']} in flight "
            f"from {result['clients']} client process(es):",
            f"    direct to stub   {result['direct_rps']:.0f} req/s   "
            f"(CPU ms/request: stubs {dc['stubs']:.3f}, clients {dc['clients']:.3f})",
            f"    through router   {result['router_rps']:.0f} req/s   (target >= 1000)",
            f"  CPU ms per request through the router: router {rc['router']:.3f} | stubs "
            f"{rc['stubs']:.3f} | clients {rc['clients']:.3f} | all {all_ms:.3f}",
            f"    by router process: {', '.join(f'{v:.3f}' for v in rc['router_by_process'])}",
            f"    router alone: {result['router_rps_per_core'] or 0:.0f} req/s per fully used "
            f"core; all processes: {cpus * 1e3 / all_ms:.0f} req/s at most on {cpus} cores",
        ]
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("colocated", "disagg"), default="colocated")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=64, help="in flight, all clients")
    parser.add_argument("--clients", type=int, default=2, help="load-client processes")
    parser.add_argument("--connections", type=int, default=4, help="per client process")
    parser.add_argument("--router-processes", type=int, default=1)
    parser.add_argument("--loop", choices=LOOP_KINDS, default="auto", help="every process's")
    parser.add_argument("--latency-requests", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument(
        "--locality", action="store_true", help="look prompts up in a Redis locality index"
    )
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--redis-url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve-router", nargs="+", metavar="ADDR|WORKER", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_router:
        address, *workers = args.serve_router
        port = int(address.rsplit(":", 1)[1])
        serving = serve_router(workers, port, args.router_processes, args.loop, args.redis_url)
        run(serving, args.loop)
        return 0
    counts = (args.requests, args.concurrency, args.clients, args.connections)
    if min(*counts, args.router_processes, args.latency_requests, args.max_tokens) < 1:
        raise SystemExit(
            "--requests, --concurrency, --clients, --connections, --router-processes, "
            "--latency-requests and --max-tokens must be >= 1"
        )
    if args.concurrency < args.clients:
        raise SystemExit(
            f"--concurrency ({args.concurrency}) must be >= --clients ({args.clients})"
        )
    result = run_bench(args)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
