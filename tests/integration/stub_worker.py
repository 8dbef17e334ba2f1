"""A STUB worker: a real grpc.aio server implementing the Worker service, no model inside.

It answers at once with deterministic tokens -- token k of every sequence is id 1000 + k
with text " w<k>" (" s<i>w<k>" for sequence i > 0) -- and applies stop strings with the
engine's real matcher. Knobs inject failures: fail before the first token, refuse
ReserveKV, hang, die mid-stream. With ``knobs.script`` set, tokens follow a script instead
(token at absolute position p is the character ``script[p % len(script)]``, as
``FakeCharTokenizer`` encodes it), so a replayed prompt continues the same text: what a
greedy model does. Used by the router tests and by bench/router_overhead.py (run it as
``python -m tests.integration.stub_worker --port P --role colocated``).

``FakeCharTokenizer`` is likewise a FAKE: one token per character, for routing tests only.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from pdserve.engine.stop_strings import StopStringMatcher
from pdserve.proto import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.proto.workers import WorkerInfo, WorkerRole
from pdserve.router.config import RouterConfig
from pdserve.router.event_loop import LOOP_KINDS
from pdserve.router.event_loop import run as run_loop
from pdserve.router.request.lifecycle import RequestLifecycle
from pdserve.router.service import RouterService, start_router
from pdserve.router.state.directory import StaticWorkerDirectory
from pdserve.worker.cluster_secret import ClusterSecret
from pdserve.worker.mutual_tls import add_worker_port, client_tls
from pdserve.worker.server import SERVER_OPTIONS

T = TypeVar("T")

FIRST_TOKEN_ID = 1000


@dataclass
class StubKnobs:
    fail_before_first_token: int = 0  # this many next Generate/Prefill calls fail (UNAVAILABLE)
    refuse_reserve: bool = False
    hang_before_first_token: bool = False
    hang_after_first_token: bool = False
    token_delay_s: float = 0.0
    # The next Generate/Decode stream sends this many chunks, then the worker dies: its
    # server stops (every caller gets UNAVAILABLE), or with die_by_ending_stream the stream
    # just ends without a finish_reason. One-shot: reset to None when it fires.
    die_after_tokens: int | None = None
    die_by_ending_stream: bool = False
    script: str | None = None  # see the module docstring


@dataclass
class StubRecord:
    calls: list[tuple[str, str]] = field(default_factory=list)  # (method, request id)
    cancels: list[str] = field(default_factory=list)  # request ids of Cancel RPCs
    streams_cancelled: list[str] = field(default_factory=list)  # streams the caller dropped
    params: list[common_pb2.SamplingParams] = field(default_factory=list)
    # (method, request id, prompt) of every call that carries a prompt
    prompts: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)
    # request id -> the peer prefix its Prefill was told to fetch first
    peer_prefixes: dict[str, worker_pb2.PeerPrefix] = field(default_factory=dict)


def token_text(index: int, k: int) -> str:
    return f" w{k}" if index == 0 else f" s{index}w{k}"


class _Sequence:
    """Produces chunk k of one sequence, applying max_tokens and stop strings."""

    def __init__(self, index: int, params: common_pb2.SamplingParams) -> None:
        self.index = index
        self.max_tokens = params.max_tokens if params.HasField("max_tokens") else 16
        self.logprobs = params.logprobs if params.HasField("logprobs") else None
        self.matcher = StopStringMatcher(tuple(params.stop), params.include_stop_str_in_output)

    def chunk(self, k: int) -> common_pb2.TokenChunk:
        text = self.matcher.feed(token_text(self.index, k)) if self.matcher.stops else None
        finish = "stop" if self.matcher.stopped else ""
        if text is None:
            text = token_text(self.index, k)
        if not finish and k + 1 >= self.max_tokens:
            finish = "length"
            text += self.matcher.flush()
        token_id = FIRST_TOKEN_ID + k
        chunk = common_pb2.TokenChunk(
            index=self.index, token_ids=[token_id], text=text, finish_reason=finish
        )
        if self.logprobs is not None:
            chunk.logprobs.append(_logprob(token_id, k, self.logprobs))
        return chunk


def _logprob(token_id: int, k: int, top: int) -> common_pb2.TokenLogprob:
    logprob = -0.25 * (k + 1)
    return common_pb2.TokenLogprob(
        token_id=token_id,
        logprob=logprob,
        top_token_ids=[token_id + j for j in range(top)],
        top_logprobs=[logprob - j for j in range(top)],
    )


class _ScriptedSequence:
    """Chunk k of one sequence after ``prompt_len`` prompt tokens, from ``script``: each
    token is one character, and text is made as the engine makes it (stop strings held
    back, a finish flushes them)."""

    def __init__(self, params: common_pb2.SamplingParams, prompt_len: int, script: str) -> None:
        self.max_tokens = params.max_tokens if params.HasField("max_tokens") else 16
        self.matcher = StopStringMatcher(tuple(params.stop), params.include_stop_str_in_output)
        self.prompt_len = prompt_len
        self.script = script

    def chunk(self, k: int) -> common_pb2.TokenChunk:
        char = self.script[(self.prompt_len + k) % len(self.script)]
        finish = "length" if k + 1 >= self.max_tokens else ""
        text = char
        if self.matcher.stops:
            text = self.matcher.feed(char)
            if self.matcher.stopped and not finish:
                finish = "stop"
            elif finish:
                text += self.matcher.flush()
        return common_pb2.TokenChunk(token_ids=[ord(char)], text=text, finish_reason=finish)


class StubWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str, role: str, knobs: StubKnobs | None = None) -> None:
        self.worker_id = worker_id
        self.role = role
        self.knobs = knobs or StubKnobs()
        self.record = StubRecord()
        self.reservations: set[str] = set()
        self.server: grpc.aio.Server | None = None  # set by start_stub_worker: dying stops it

    def _sequence(self, index: int, request: Any) -> _Sequence | _ScriptedSequence:
        if self.knobs.script is None:
            return _Sequence(index, request.params)
        assert index == 0, "scripted stubs serve one sequence per request"
        return _ScriptedSequence(request.params, len(request.prompt_token_ids), self.knobs.script)

    async def Generate(self, request, context) -> AsyncIterator[common_pb2.TokenChunk]:
        self._note("Generate", request.request_id, request.params, request.prompt_token_ids)
        await self._before_first_token(context, request.request_id)
        n = request.params.n if request.params.HasField("n") else 1
        sequences = [self._sequence(i, request) for i in range(n)]
        async for chunk in self._stream(sequences, 0, context, request.request_id):
            yield chunk

    async def Prefill(self, request, context) -> AsyncIterator[worker_pb2.PrefillEvent]:
        self._note("Prefill", request.request_id, request.params, request.prompt_token_ids)
        if request.HasField("peer_prefix"):
            self.record.peer_prefixes[request.request_id] = request.peer_prefix
        await self._before_first_token(context, request.request_id)
        yield worker_pb2.PrefillEvent(first_token=self._sequence(0, request).chunk(0))
        report = worker_pb2.TransferReport(
            ok=True, bytes=100 * len(request.prompt_token_ids), seconds=0.002
        )
        yield worker_pb2.PrefillEvent(transfer=report)

    async def ReserveKV(self, request, context) -> worker_pb2.ReserveKVResponse:
        self._note("ReserveKV", request.request_id, None, request.prompt_token_ids)
        if self.knobs.refuse_reserve:
            return worker_pb2.ReserveKVResponse(accepted=False)
        self.reservations.add(request.request_id)
        blocks = -(-len(request.prompt_token_ids) // 16)
        destination = worker_pb2.KVDestination(
            worker_id=self.worker_id, backend="tcp", block_ids=list(range(blocks))
        )
        return worker_pb2.ReserveKVResponse(accepted=True, destination=destination)

    async def Decode(self, request, context) -> AsyncIterator[common_pb2.TokenChunk]:
        self._note("Decode", request.request_id, request.params, request.prompt_token_ids)
        if request.request_id not in self.reservations:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no reservation")
        sequence = self._sequence(0, request)
        sequence.chunk(0)  # the first token came from the prefill worker: feed its text
        async for chunk in self._stream([sequence], 1, context, request.request_id):
            yield chunk
        self.reservations.discard(request.request_id)

    async def Cancel(self, request, context) -> worker_pb2.CancelResponse:
        self.record.cancels.append(request.request_id)
        found = request.request_id in self.reservations
        self.reservations.discard(request.request_id)
        return worker_pb2.CancelResponse(found=found)

    async def GetStats(self, request, context) -> worker_pb2.WorkerStats:
        return worker_pb2.WorkerStats(worker_id=self.worker_id, role=self.role, free_blocks=1000)

    def _note(
        self,
        method: str,
        request_id: str,
        params: common_pb2.SamplingParams | None,
        prompt: Any = (),
    ):
        self.record.calls.append((method, request_id))
        self.record.prompts.append((method, request_id, tuple(prompt)))
        if params is not None:
            self.record.params.append(params)

    async def _before_first_token(self, context, request_id: str) -> None:
        if self.knobs.fail_before_first_token > 0:
            self.knobs.fail_before_first_token -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "stub: injected failure")
        if self.knobs.hang_before_first_token:
            await self._hang(request_id)

    async def _stream(self, sequences, start_k, context, request_id):
        running = list(sequences)
        k = start_k
        sent = 0
        while running:
            for seq in list(running):
                if sent == self.knobs.die_after_tokens:
                    await self._die(request_id)
                    return
                chunk = seq.chunk(k)
                yield chunk
                sent += 1
                if chunk.finish_reason:
                    running.remove(seq)
            if k == start_k and self.knobs.hang_after_first_token:
                await self._hang(request_id)
            if self.knobs.token_delay_s:
                await asyncio.sleep(self.knobs.token_delay_s)
            k += 1

    async def _die(self, request_id: str) -> None:
        """Die mid-stream (see ``StubKnobs.die_after_tokens``)."""
        self.knobs.die_after_tokens = None
        if self.knobs.die_by_ending_stream:
            return
        assert self.server is not None, "a stub dies by stopping its server"
        asyncio.get_running_loop().create_task(self.server.stop(None))
        await self._hang(request_id)

    async def _hang(self, request_id: str) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.record.streams_cancelled.append(request_id)
            raise


async def start_stub_worker(
    worker_id: str,
    role: str,
    knobs: StubKnobs | None = None,
    port: int = 0,
    secret: ClusterSecret | None = None,
) -> tuple[grpc.aio.Server, str, StubWorker]:
    """A started stub on loopback (mutual TLS with ``secret``, as a real worker); returns
    the server, its address and the servicer."""
    server = grpc.aio.server(options=SERVER_OPTIONS)  # the pings a real worker accepts
    servicer = StubWorker(worker_id, role, knobs)
    servicer.server = server
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = add_worker_port(server, f"127.0.0.1:{port}", secret)
    await server.start()
    return server, f"127.0.0.1:{bound}", servicer


class FakeCharTokenizer:
    """A FAKE tokenizer: token id = code point, BOS = 1, EOS = 2. Not a real model's."""

    eos_token_id = 2
    vocab_size = 50_000

    def __init__(self, max_context_tokens: int = 256, model_id: str = "fake-model") -> None:
        self.max_context_tokens = max_context_tokens
        self.model_id = model_id

    def encode(self, text: str) -> list[int]:
        return [1, *(min(ord(c), self.vocab_size - 1) for c in text)]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        turns = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return self.encode(turns + "<|assistant|>")

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids if i > 2)


@dataclass
class StubCluster:
    """Stub workers plus a real router (gRPC and HTTP servers) on an event loop in a thread.

    Tests drive it with ordinary blocking clients; ``workers`` are the stub servicers by id,
    whose knobs and records tests may set and read.
    """

    config: RouterConfig
    workers: dict[str, StubWorker]
    grpc_address: str
    http_url: str
    lifecycle: RequestLifecycle
    loop: asyncio.AbstractEventLoop
    _thread: threading.Thread
    _teardown: list[Callable[[], Awaitable[None]]]

    def run(self, coro: Awaitable[T], timeout_s: float = 30.0) -> T:
        """Run ``coro`` on the cluster's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)  # type: ignore[arg-type]

    def stop(self) -> None:
        async def teardown() -> None:
            for step in reversed(self._teardown):
                await step()

        self.run(teardown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def start_stub_cluster(
    roles: dict[str, str],
    config: RouterConfig | None = None,
    tokenizer: FakeCharTokenizer | None = None,
    locality: Any = None,
    hasher: Any = None,
    secret: ClusterSecret | None = None,
) -> StubCluster:
    """Start one stub worker per ``{worker_id: role}`` and a router in front of them; with
    ``secret``, the workers serve mutual TLS and the router calls them with its certificate."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="stub-cluster", daemon=True)
    thread.start()
    config = config or RouterConfig()
    tokenizer = tokenizer or FakeCharTokenizer()
    setup = _setup(roles, config, tokenizer, locality, hasher, secret, loop, thread)
    return asyncio.run_coroutine_threadsafe(setup, loop).result(30)


async def _setup(roles, config, tokenizer, locality, hasher, secret, loop, thread) -> StubCluster:
    teardown: list[Callable[[], Awaitable[None]]] = []
    workers, infos = {}, []
    for worker_id, role in roles.items():
        server, address, servicer = await start_stub_worker(worker_id, role, secret=secret)
        teardown.append(partial(server.stop, None))
        workers[worker_id] = servicer
        infos.append(WorkerInfo(worker_id, WorkerRole(role), address))
    config = replace(config, grpc_port=0, http_port=0)
    directory = StaticWorkerDirectory(infos)
    worker_tls = client_tls(secret) if secret is not None else None
    service = await start_router(
        config, tokenizer, directory, locality, hasher, worker_tls=worker_tls
    )
    teardown.append(partial(service.stop, None))
    return StubCluster(
        config,
        workers,
        f"127.0.0.1:{service.grpc_port}",
        f"http://127.0.0.1:{service.http_port}",
        service.lifecycle,
        loop,
        thread,
        teardown,
    )


def start_router_for(
    infos: list[WorkerInfo], tokenizer: Any, config: RouterConfig | None = None
) -> StubCluster:
    """A real router on a loop in a thread in front of the given (real) workers; the
    returned cluster has no stub ``workers``."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="router", daemon=True)
    thread.start()
    config = replace(config or RouterConfig(), grpc_port=0, http_port=0)

    async def setup() -> StubCluster:
        service = await start_router(config, tokenizer, StaticWorkerDirectory(infos))
        grpc_address = f"127.0.0.1:{service.grpc_port}"
        http_url = f"http://127.0.0.1:{service.http_port}"
        teardown: list[Callable[[], Awaitable[None]]] = [partial(service.stop, None)]
        return StubCluster(
            config, {}, grpc_address, http_url, service.lifecycle, loop, thread, teardown
        )

    return asyncio.run_coroutine_threadsafe(setup(), loop).result(30)


async def router_for_stubs(infos: tuple[WorkerInfo, ...], config: RouterConfig) -> RouterService:
    """A router in front of ``infos`` with the FAKE tokenizer. Picklable as
    ``functools.partial(router_for_stubs, infos)``: a factory for
    ``pdserve.router.processes.start_router_processes``."""
    return await start_router(config, FakeCharTokenizer(), StaticWorkerDirectory(infos))


def main() -> None:
    parser = argparse.ArgumentParser(description="Run one STUB worker (no model) on loopback.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--role", default="colocated")
    parser.add_argument("--worker-id", default="stub")
    parser.add_argument("--loop", choices=LOOP_KINDS, default="asyncio", help="event loop")
    args = parser.parse_args()

    async def serve() -> None:
        server, address, _ = await start_stub_worker(args.worker_id, args.role, port=args.port)
        print(f"stub worker {args.worker_id} ({args.role}) on {address}", flush=True)
        await server.wait_for_termination()

    run_loop(serve(), args.loop)


if __name__ == "__main__":
    main()
