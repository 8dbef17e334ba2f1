"""Load for bench/router_overhead.py: the calls, load-client processes, CPU accounting.

A load client is a process of its own (``python -m pdserve.bench.router_load ...``) so that the
client is not the bottleneck: K of them drive the router (or a stub directly) together.
Each connects and warms up, prints ``ready``, waits for ``go`` on stdin, runs its share
and prints one JSON line: its requests, seconds and CPU seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.proto import common_pb2, inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
PROMPT = list(range(1, 33))  # 32 token ids: two full blocks
Call = Callable[[], Awaitable[int]]


def params(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)


def via_router(channel: grpc.aio.Channel, max_tokens: int) -> Call:
    stub = inference_pb2_grpc.InferenceStub(channel)
    request = inference_pb2.GenerateTextRequest(
        token_ids=inference_pb2.TokenIds(ids=PROMPT), params=params(max_tokens)
    )

    async def call() -> int:
        return sum([len(r.chunk.token_ids) async for r in stub.Generate(request)])

    return call


def direct_colocated(channel: grpc.aio.Channel, max_tokens: int) -> Call:
    stub = worker_pb2_grpc.WorkerStub(channel)
    request = worker_pb2.GenerateRequest(
        request_id="direct", prompt_token_ids=PROMPT, params=params(max_tokens)
    )

    async def call() -> int:
        return sum([len(c.token_ids) async for c in stub.Generate(request)])

    return call


_REQUEST_IDS = itertools.count()  # one sequence per process: several connections share it


def direct_disagg(prefill: grpc.aio.Channel, decode: grpc.aio.Channel, max_tokens: int) -> Call:
    """The RPCs the router makes for one disaggregated request, made by the client."""
    p_stub, d_stub = worker_pb2_grpc.WorkerStub(prefill), worker_pb2_grpc.WorkerStub(decode)
    sampling = params(max_tokens)
    tag = os.getpid()  # several client processes: request ids must not collide

    async def call() -> int:
        rid = f"direct-{tag}-{next(_REQUEST_IDS)}"  # the decode stub keys reservations by id
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


# Its own TCP connection per channel: grpc otherwise shares one per target in a process,
# and the kernel spreads connections, not requests, over router processes on one port.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def make_call(target: Sequence[str], max_tokens: int) -> tuple[Call, list[grpc.aio.Channel]]:
    """``["router", addr]``, ``["colocated", addr]`` or ``["disagg", prefill, decode]``,
    over new connections."""
    kind, *addresses = target
    channels = [grpc.aio.insecure_channel(a, options=OWN_CONNECTION) for a in addresses]
    if kind == "router":
        return via_router(channels[0], max_tokens), channels
    if kind == "colocated":
        return direct_colocated(channels[0], max_tokens), channels
    assert kind == "disagg", f"unknown target {kind!r}"
    return direct_disagg(channels[0], channels[1], max_tokens), channels


async def latencies_ms(call: Call, count: int) -> list[float]:
    for _ in range(min(50, count)):  # warm-up: channels, caches
        await call()
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


async def drive(calls: Sequence[Call], total: int, concurrency: int) -> None:
    """``total`` calls with ``concurrency`` in flight, spread over ``calls``."""
    remaining = total

    async def worker(call: Call) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await call()

    await asyncio.gather(*(worker(calls[i % len(calls)]) for i in range(concurrency)))


# --- CPU accounting (Linux /proc) -----------------------------------------------------------


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far; 0 when gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                queue += [
                    int(c) for c in Path(f"/proc/{current}/task/{tid}/children").read_text().split()
                ]
            except OSError:
                continue
    return found


def tree_cpu_s(pids: Sequence[int]) -> dict[int, float]:
    """CPU seconds so far of each process in the trees under ``pids``, by pid."""
    return {p: cpu_s(p) for root in pids for p in descendants(root)}


def cpu_used_s(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two ``tree_cpu_s`` samples (processes that left: ignored)."""
    return sum(after[p] - before.get(p, 0.0) for p in after)


# --- load-client processes -------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class LoadResult:
    requests: int
    elapsed_s: float  # from "go" to the last client's last response
    client_cpu_s: float  # all client processes together

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed_s


def spawn_module(module: str, args: Sequence[str], **popen: object) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env, **popen)  # type: ignore[call-overload]


@dataclass(slots=True, frozen=True)
class LoadShape:
    """How the load is made: ``total`` requests of ``max_tokens`` tokens from ``clients``
    processes with ``concurrency`` in flight overall, each client over ``connections``
    connections, every process on event loop ``loop``."""

    total: int
    concurrency: int
    clients: int
    connections: int
    max_tokens: int
    loop: str


def run_clients(
    target: Sequence[str], shape: LoadShape, on_go: Callable[[], None] = lambda: None
) -> LoadResult:
    """Run ``shape`` against ``target``; ``on_go`` runs just before the clients are
    released (start CPU samples there)."""
    total, concurrency, clients = shape.total, shape.concurrency, shape.clients
    shares = [total // clients + (i < total % clients) for i in range(clients)]
    in_flight = [concurrency // clients + (i < concurrency % clients) for i in range(clients)]
    procs = [
        spawn_module(
            "pdserve.bench.router_load",
            [
                *("--requests", str(n), "--concurrency", str(max(1, c))),
                *("--max-tokens", str(shape.max_tokens), "--loop", shape.loop),
                *("--connections", str(shape.connections), *target),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for n, c in zip(shares, in_flight, strict=True)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdin is not None
            line = proc.stdout.readline().decode().strip()
            assert line == "ready", f"load client {proc.pid} said {line!r}, not ready"
        on_go()
        start = time.perf_counter()
        for proc in procs:
            proc.stdin.write(b"go\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        results = [json.loads(proc.stdout.readline()) for proc in procs]  # type: ignore[union-attr]
        elapsed_s = time.perf_counter() - start
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    finally:
        for proc in procs:
            proc.wait(timeout=30)
    return LoadResult(
        sum(r["requests"] for r in results), elapsed_s, sum(r["cpu_s"] for r in results)
    )


async def _client(args: argparse.Namespace) -> dict[str, float]:
    made = [make_call(args.target, args.max_tokens) for _ in range(args.connections)]
    calls = [call for call, _ in made]
    for call in calls:
        got = await call()
        assert got == args.max_tokens, f"{args.target[0]} sent {got} tokens, not {args.max_tokens}"
    await drive(calls, min(100, args.requests), args.concurrency)  # warm-up
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # "go"
    cpu_before_s = sum(os.times()[:2])
    start = time.perf_counter()
    await drive(calls, args.requests, args.concurrency)
    elapsed_s = time.perf_counter() - start
    for _, channels in made:
        for channel in channels:
            await channel.close()
    cpu_s = sum(os.times()[:2]) - cpu_before_s
    return {"requests": args.requests, "elapsed_s": elapsed_s, "cpu_s": cpu_s}


def main(argv: list[str] | None = None) -> int:
    from pdserve.router.event_loop import run

    parser = argparse.ArgumentParser(description="One load-client process (see the docstring).")
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--connections", type=int, default=4, help="to each target address")
    parser.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto")
    parser.add_argument("target", nargs="+", help="router ADDR | colocated ADDR | disagg P D")
    args = parser.parse_args(argv)
    print(json.dumps(run(_client(args), args.loop)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
