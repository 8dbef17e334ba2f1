"""Router overhead on loopback: added latency and sustained requests/s, with STUB workers.

    python -m bench.router_overhead [--mode colocated|disagg] [--requests 2000]
                                    [--concurrency 32] [--latency-requests 300]
                                    [--max-tokens 4] [--json out.json]

Three processes: stub worker(s) (``tests/integration/stub_worker.py``: a real gRPC server
that answers at once, no model), the router (gRPC Inference server, token-id prompts), and
this load generator (grpc.aio). Latency: requests one at a time, to the stub directly (the
same RPCs the router makes: Generate; or ReserveKV, Prefill, Decode) and through the
router; added p50 = router p50 - direct p50. Throughput: ``--requests`` through the router
with ``--concurrency`` in flight. The client shares the machine's cores with the router and
stubs, so the req/s figure is a lower bound on what the router alone sustains.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from pdserve_proto import common_pb2, inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
PROMPT = list(range(1, 33))  # 32 token ids: two full blocks


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn(args: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env)


# --- the router process --------------------------------------------------------------------


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


async def serve_router(workers: list[str], port: int) -> None:
    """The router with its default policy, in front of ``id=role@host:port`` workers."""
    from router.config import RouterConfig
    from router.directory import StaticWorkerDirectory, WorkerInfo
    from router.policies import WorkerRole
    from router.service import start_router

    infos = []
    for spec in workers:
        worker_id, rest = spec.split("=", 1)
        role, address = rest.split("@", 1)
        infos.append(WorkerInfo(worker_id, address, WorkerRole(role)))
    config = RouterConfig(grpc_port=port, http_port=0, max_concurrent_requests=100_000)
    service = await start_router(config, BenchTokenizer(), StaticWorkerDirectory(infos))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()  # a clean exit on SIGTERM (lets a profiler write its output)
    await service.stop(grace_s=None)


# --- the load generator --------------------------------------------------------------------


def params(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)


def via_router(channel: grpc.aio.Channel, max_tokens: int) -> Callable[[], Awaitable[int]]:
    stub = inference_pb2_grpc.InferenceStub(channel)
    request = inference_pb2.GenerateTextRequest(
        token_ids=inference_pb2.TokenIds(ids=PROMPT), params=params(max_tokens)
    )

    async def call() -> int:
        return sum([len(r.chunk.token_ids) async for r in stub.Generate(request)])

    return call


def direct_colocated(channel: grpc.aio.Channel, max_tokens: int) -> Callable[[], Awaitable[int]]:
    stub = worker_pb2_grpc.WorkerStub(channel)
    request = worker_pb2.GenerateRequest(
        request_id="direct", prompt_token_ids=PROMPT, params=params(max_tokens)
    )

    async def call() -> int:
        return sum([len(c.token_ids) async for c in stub.Generate(request)])

    return call


def direct_disagg(
    prefill: grpc.aio.Channel, decode: grpc.aio.Channel, max_tokens: int
) -> Callable[[], Awaitable[int]]:
    p_stub, d_stub = worker_pb2_grpc.WorkerStub(prefill), worker_pb2_grpc.WorkerStub(decode)
    sampling = params(max_tokens)
    ids = itertools.count()

    async def call() -> int:
        rid = f"direct-{next(ids)}"  # the decode stub keys reservations by request id
        reserve = await d_stub.ReserveKV(
            worker_pb2.ReserveKVRequest(request_id=rid, prompt_token_ids=PROMPT)
        )
        prefill_request = worker_pb2.PrefillRequest(
            request_id=rid,
            prompt_token_ids=PROMPT,
            params=sampling,
            destination=reserve.destination,
        )
        events = [e async for e in p_stub.Prefill(prefill_request)]
        first = events[0].first_token
        decode_request = worker_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=PROMPT, params=sampling, first_token=first
        )
        rest = [c async for c in d_stub.Decode(decode_request)]
        return len(first.token_ids) + sum(len(c.token_ids) for c in rest)

    return call


async def latencies_ms(call: Callable[[], Awaitable[int]], count: int) -> list[float]:
    for _ in range(min(50, count)):  # warm-up: channels, caches
        await call()
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


async def throughput_rps(call: Callable[[], Awaitable[int]], total: int, concurrency: int) -> float:
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await call()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - start)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentiles(samples: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(samples, n=100)
    return {"p50": statistics.median(samples), "p90": cuts[89], "p99": cuts[98]}


async def wait_ready(address: str, timeout_s: float = 30.0) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)


async def measure(
    args: argparse.Namespace, stubs: dict[str, str], router: str, router_pid: int
) -> dict:
    for address in [*stubs.values(), router]:
        await wait_ready(address)
    channels = {name: grpc.aio.insecure_channel(a) for name, a in stubs.items()}
    router_channel = grpc.aio.insecure_channel(router)
    if args.mode == "colocated":
        direct = direct_colocated(channels["w0"], args.max_tokens)
    else:
        direct = direct_disagg(channels["p0"], channels["d0"], args.max_tokens)
    routed = via_router(router_channel, args.max_tokens)
    assert await routed() == await direct() == args.max_tokens, "router and stub disagree"
    direct_ms = percentiles(await latencies_ms(direct, args.latency_requests))
    router_ms = percentiles(await latencies_ms(routed, args.latency_requests))
    direct_rps = await throughput_rps(direct, args.requests, args.concurrency)
    cpu_before_s = cpu_s(router_pid)
    router_rps = await throughput_rps(routed, args.requests, args.concurrency)
    router_cpu_ms = (cpu_s(router_pid) - cpu_before_s) * 1e3 / args.requests
    for channel in [*channels.values(), router_channel]:
        await channel.close()
    return {
        "mode": args.mode,
        "max_tokens": args.max_tokens,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "latency_requests": args.latency_requests,
        "direct_ms": direct_ms,
        "router_ms": router_ms,
        "added_p50_ms": router_ms["p50"] - direct_ms["p50"],
        "direct_rps": direct_rps,
        "router_rps": router_rps,
        "cpus": os.cpu_count(),
        "router_cpu_ms_per_request": router_cpu_ms,
        "router_rps_per_core": 1e3 / router_cpu_ms if router_cpu_ms > 0 else None,
    }


def run(args: argparse.Namespace) -> dict:
    roles = {"w0": "colocated"} if args.mode == "colocated" else {"p0": "prefill", "d0": "decode"}
    stubs = {name: f"127.0.0.1:{free_port()}" for name in roles}
    router = f"127.0.0.1:{free_port()}"
    procs = [
        spawn(
            [
                "tests.integration.stub_worker",
                "--port",
                a.rsplit(":", 1)[1],
                "--role",
                roles[name],
                "--worker-id",
                name,
            ]
        )
        for name, a in stubs.items()
    ]
    specs = [f"{name}={roles[name]}@{a}" for name, a in stubs.items()]
    procs.append(spawn(["bench.router_overhead", "--serve-router", router, *specs]))
    try:
        return asyncio.run(measure(args, stubs, router, procs[-1].pid))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def report(result: dict) -> str:
    d, r = result["direct_ms"], result["router_ms"]
    return "\n".join(
        [
            f"router overhead ({result['mode']}, {result['max_tokens']} tokens/request, "
            f"{result['cpus']} CPUs shared by client, router and stubs)",
            f"  latency, 1 in flight, {result['latency_requests']} requests (ms):",
            f"    direct to stub   p50 {d['p50']:.3f}  p90 {d['p90']:.3f}  p99 {d['p99']:.3f}",
            f"    through router   p50 {r['p50']:.3f}  p90 {r['p90']:.3f}  p99 {r['p99']:.3f}",
            f"    added p50        {result['added_p50_ms']:.3f} ms   (target < 2 ms)",
            f"  throughput, {result['requests']} requests, {result['concurrency']} in flight:",
            f"    direct to stub   {result['direct_rps']:.0f} req/s",
            f"    through router   {result['router_rps']:.0f} req/s   (target >= 1000)",
            f"  router CPU per request {result['router_cpu_ms_per_request']:.3f} ms "
            f"= {result['router_rps_per_core'] or 0:.0f} req/s per fully used core",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("colocated", "disagg"), default="colocated")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--latency-requests", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--serve-router", nargs="+", metavar="ADDR|WORKER", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_router:
        address, *workers = args.serve_router
        asyncio.run(serve_router(workers, int(address.rsplit(":", 1)[1])))
        return 0
    if min(args.requests, args.concurrency, args.latency_requests, args.max_tokens) < 1:
        raise SystemExit("--requests, --concurrency, --latency-requests, --max-tokens must be >= 1")
    result = run(args)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
