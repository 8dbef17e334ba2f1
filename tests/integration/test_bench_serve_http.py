"""The whole serving benchmark against tiny real servers on loopback.

The HTTP server (FastAPI + uvicorn) streams OpenAI-format chunks after an injected delay and
exposes Prometheus counters; the gRPC server implements ``pdserve.v1.Inference.Generate``. Both
are written here so their delays and counts are known exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from pdserve.bench.serve import (
    SLO,
    BenchConfig,
    MultiTurnSpec,
    RandomSpec,
    SharedPrefixSpec,
    add_serve_arguments,
    run_benchmark,
    run_serve_bench,
)
from pdserve.bench.serve.plots import GOODPUT_VS_RATE_PNG, LATENCY_CDF_PNG
from pdserve.proto import common_pb2, inference_pb2, inference_pb2_grpc

TTFT_DELAY_S = 0.05
ITL_DELAY_S = 0.002
KV_BYTES_PER_REQUEST = 1000
MODEL = "fake-model"
PARAGRAPHS = (
    "Prefill computes the prompt and decode generates the rest one token at a time.",
    "The router picks a prefill worker that already holds the longest cached prefix.",
)


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(token_ids).decode(errors="replace")


@dataclass
class FakeState:
    """What the fake server saw; the tests read it after a run."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    requests: int = 0
    fail_every: int = 0  # every n-th request gets HTTP 500 (0 = never)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.bodies.clear()
            self.replies.clear()
            self.fail_every = 0

    def metrics_text(self) -> str:
        with self.lock:
            hits, prompt, n = self.prompt_tokens // 2, self.prompt_tokens, self.requests
        return (
            "# TYPE pdserve_prefix_hit_tokens_total counter\n"
            f'pdserve_prefix_hit_tokens_total{{worker="p0"}} {hits}\n'
            "# TYPE pdserve_prompt_tokens_total counter\n"
            f"pdserve_prompt_tokens_total {prompt}\n"
            "# TYPE pdserve_kv_transfer_bytes_total counter\n"
            f"pdserve_kv_transfer_bytes_total {n * KV_BYTES_PER_REQUEST}\n"
        )


def _create_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics_text())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        return _stream_or_fail(state, body, len(body["prompt"]), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        prompt = sum(len(m["content"].split()) for m in body["messages"])
        return _stream_or_fail(state, body, prompt, chat=True)

    return app


def _stream_or_fail(state: FakeState, body: dict[str, Any], prompt_tokens: int, chat: bool) -> Any:
    with state.lock:
        state.bodies.append(body)
        index = len(state.bodies)
        if state.fail_every and index % state.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        state.prompt_tokens += prompt_tokens
        state.requests += 1
    events = _events(state, body["max_tokens"], prompt_tokens, chat, index)
    return StreamingResponse(events, media_type="text/event-stream")


async def _events(
    state: FakeState, max_tokens: int, prompt_tokens: int, chat: bool, index: int
) -> AsyncIterator[str]:
    await asyncio.sleep(TTFT_DELAY_S)
    words = [f"r{index}w{i} " for i in range(max_tokens)]
    for i, word in enumerate(words):
        if i:
            await asyncio.sleep(ITL_DELAY_S)
        finish = "length" if i == max_tokens - 1 else None
        choice = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
        yield _sse({"choices": [{**choice, "finish_reason": finish}]})
    with state.lock:
        state.replies.append("".join(words))
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens}
    yield _sse({"choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps({'id': 'x', 'model': MODEL, **payload})}\n\n"


@dataclass
class FakeServer:
    base_url: str
    state: FakeState


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(_create_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline, "the fake OpenAI server did not start in 10 s"
        time.sleep(0.01)
    yield FakeServer(f"http://127.0.0.1:{port}", state)
    uv.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def fake(server: FakeServer) -> FakeServer:
    server.state.reset()
    return server


def _config(fake: FakeServer, **overrides: Any) -> BenchConfig:
    fields: dict[str, Any] = {
        "dataset": RandomSpec(input_tokens=32, output_tokens=6),
        "num_prompts": 8,
        "base_url": fake.base_url,
        "show_progress": False,
        "corpus": PARAGRAPHS,
        "tokenizer": ByteTokenizer(),
        "seed": 1,
    }
    return BenchConfig(**{**fields, **overrides})


def test_completions_counts_ttft_and_server_figures(fake: FakeServer) -> None:
    result = run_benchmark(_config(fake, max_concurrency=3, warmup=2))
    assert result.model == MODEL and result.warmup_failed == 0
    (run,) = result.runs
    assert run.summary.completed == 8 and run.summary.failed == 0
    assert run.summary.output_tokens == 8 * 6 and run.summary.input_tokens == 8 * 32
    for out in run.outputs:
        assert out.ttft_s >= TTFT_DELAY_S
        assert len(out.itl_s) == 5
        assert out.e2e_s >= out.ttft_s + sum(out.itl_s) - 1e-9
        assert out.tpot_s == pytest.approx((out.e2e_s - out.ttft_s) / 5)
    assert run.summary.ttft.p50_ms >= TTFT_DELAY_S * 1000
    # Warmup (2) + run (8) requests reached the server, all as token ids of exact length.
    bodies = fake.state.bodies
    assert len(bodies) == 10
    assert all(isinstance(b["prompt"], list) and len(b["prompt"]) == 32 for b in bodies)
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in bodies)
    # Counters cover the measured run only (the warmup happened before the first scrape).
    assert run.server.kv_transfer_bytes == 8 * KV_BYTES_PER_REQUEST
    assert run.server.prompt_tokens == 8 * 32
    assert run.server.prefix_hit_rate == pytest.approx(0.5)
    assert run.server.kv_transfer_s is None  # not exposed by this server -> n/a


def test_sweep_goodput_json_and_plots(fake: FakeServer, tmp_path: Path) -> None:
    from pdserve.bench.serve.plots import write_plots
    from pdserve.bench.serve.report import format_run, write_json

    # A TTFT SLO below the injected delay can never be met.
    slo = SLO(ttft_ms=TTFT_DELAY_S * 500)
    corpus = (" ".join(f"word{i}" for i in range(2000)),)  # no text repeats within it
    config = _config(fake, request_rates=(40.0, math.inf), slo=slo, corpus=corpus)
    result = run_benchmark(config)
    assert [r.request_rate for r in result.runs] == [40.0, math.inf]
    for run in result.runs:
        assert run.summary.completed == 8
        assert run.summary.goodput == 0.0 and run.summary.slo_attainment == 0.0
    # Each rate draws its own prompts, so one run does not warm the cache for the next.
    prompts = [tuple(b["prompt"]) for b in fake.state.bodies]
    assert len(set(prompts[:8]) & set(prompts[8:])) == 0
    write_json(result, tmp_path / "out.json")
    record = json.loads((tmp_path / "out.json").read_text(), parse_constant=_reject)
    assert [r["request_rate"] for r in record["runs"]] == [40.0, "inf"]
    assert len(record["runs"][1]["requests"]) == 8
    assert record["runs"][0]["summary"]["goodput"] == 0.0
    assert record["config"]["dataset"]["name"] == "random"
    assert "Request goodput (req/s):" in format_run(result, result.runs[0])
    written = write_plots(result, tmp_path / "plots")
    assert {p.name for p in written} == {LATENCY_CDF_PNG, GOODPUT_VS_RATE_PNG}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


def _reject(constant: str) -> None:
    raise AssertionError(f"non-standard JSON constant {constant} in the output")


def test_generous_slo_is_met_by_every_request(fake: FakeServer) -> None:
    result = run_benchmark(_config(fake, slo=SLO(ttft_ms=60_000, tpot_ms=60_000)))
    summary = result.runs[0].summary
    assert summary.slo_attainment == 1.0
    assert summary.goodput == pytest.approx(summary.request_throughput)


def test_multi_turn_resends_history_with_the_replies(fake: FakeServer) -> None:
    spec = MultiTurnSpec(num_turns=3, turn_input_tokens=8, turn_output_tokens=4)
    result = run_benchmark(_config(fake, dataset=spec, num_prompts=2, tokenizer=None))
    run = result.runs[0]
    assert run.summary.completed == 6 and run.summary.failed == 0
    bodies = fake.state.bodies
    assert sorted(len(b["messages"]) for b in bodies) == [1, 1, 3, 3, 5, 5]
    replies = set(fake.state.replies)
    for body in bodies:
        roles = [m["role"] for m in body["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        assert all(m["content"] in replies for m in body["messages"] if m["role"] == "assistant")


def test_shared_prefix_requests_reach_the_server_with_the_prefix(fake: FakeServer) -> None:
    spec = SharedPrefixSpec(num_groups=2, prefix_tokens=20, question_tokens=4, output_tokens=2)
    run_benchmark(_config(fake, dataset=spec, num_prompts=6))
    heads = {tuple(b["prompt"][:20]) for b in fake.state.bodies}
    assert len(heads) == 2 and len(fake.state.bodies) == 6


def test_failures_are_counted_and_explained(fake: FakeServer) -> None:
    fake.state.fail_every = 2
    result = run_benchmark(_config(fake, max_concurrency=1))
    run = result.runs[0]
    assert run.summary.completed == 4 and run.summary.failed == 4
    failed = [o for o in run.outputs if not o.success]
    assert all("HTTP 500" in o.error and "injected failure" in o.error for o in failed)
    assert run.summary.output_tokens == 4 * 6


def test_missing_metrics_endpoint_gives_na(fake: FakeServer) -> None:
    result = run_benchmark(_config(fake, metrics_url=f"{fake.base_url}/no-such-metrics"))
    server = result.runs[0].server
    assert server.prefix_hit_rate is None and server.kv_transfer_bytes is None


def test_cli_prints_the_table_and_writes_json(
    fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    out = tmp_path / "cli.json"
    args = parser.parse_args(
        ["--base-url", fake.base_url, "--dataset-name", "random", "--num-prompts", "4",
         "--random-input-len", "16", "--random-output-len", "3", "--tokenizer", "none",
         "--goodput", "ttft:60000", "--disable-tqdm", "--json", str(out)]
    )  # fmt: skip
    assert run_serve_bench(args) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Successful requests:" in printed
    assert json.loads(out.read_text())["runs"][0]["summary"]["completed"] == 4
    assert all(isinstance(b["prompt"], str) for b in fake.state.bodies)  # words rule: text


class _FakeInference(inference_pb2_grpc.InferenceServicer):
    def __init__(self) -> None:
        self.requests: list[inference_pb2.GenerateTextRequest] = []

    def Generate(self, request: Any, context: Any) -> Iterator[Any]:
        self.requests.append(request)
        time.sleep(TTFT_DELAY_S)
        n = request.params.max_tokens
        for i in range(n):
            if i:
                time.sleep(ITL_DELAY_S)
            done = i == n - 1
            chunk = common_pb2.TokenChunk(
                token_ids=[100 + i], text=f" t{i}", finish_reason="length" if done else ""
            )
            usage = inference_pb2.Usage(
                prompt_tokens=len(request.token_ids.ids), completion_tokens=n
            )
            yield inference_pb2.GenerateTextResponse(chunk=chunk, usage=usage if done else None)

    def ListModels(self, request: Any, context: Any) -> Any:
        return inference_pb2.ListModelsResponse(models=[inference_pb2.ModelInfo(id=MODEL)])


def test_grpc_backend(fake: FakeServer) -> None:
    servicer = _FakeInference()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        config = _config(fake, backend="grpc", grpc_target=f"127.0.0.1:{port}", num_prompts=5)
        run = run_benchmark(config).runs[0]
    finally:
        grpc_server.stop(grace=None)
    assert run.summary.completed == 5 and run.summary.output_tokens == 5 * 6
    assert all(o.ttft_s >= TTFT_DELAY_S and len(o.itl_s) == 5 for o in run.outputs)
    assert all(len(r.token_ids.ids) == 32 and r.model == MODEL for r in servicer.requests)
