"""Runs a benchmark: warm up, then for each request rate send the dataset on its arrival
schedule (under the concurrency cap), time every stream, and read server counters around it.

::

    warmup (all at once) -> for rate in rates:
        scrape /metrics -> dispatch items at Poisson offsets -> await all -> scrape /metrics
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from tqdm import tqdm

from pdserve.bench.serve.arrivals import arrival_offsets_s
from pdserve.bench.serve.config import BenchConfig, BenchResult, RateResult
from pdserve.bench.serve.datasets import (
    BenchRequest,
    Conversation,
    Item,
    build_dataset,
    count_requests,
)
from pdserve.bench.serve.metrics import summarize
from pdserve.bench.serve.openai_client import OpenAIClient
from pdserve.bench.serve.outputs import BenchClient, RequestOptions, RequestOutput
from pdserve.bench.serve.server_metrics import ServerFigures, figures, scrape
from pdserve.bench.serve.text import TextSource, load_corpus_paragraphs

WARMUP_SEED_OFFSET = 1_000_003  # warmup prompts differ from every measured run's prompts
METRICS_TIMEOUT_S = 5.0
OnRun = Callable[[BenchResult], None]  # sees the result so far after each run


def run_benchmark(config: BenchConfig, on_run: OnRun | None = None) -> BenchResult:
    """Run the benchmark in a fresh event loop (see :func:`arun_benchmark`)."""
    return asyncio.run(arun_benchmark(config, on_run))


async def arun_benchmark(config: BenchConfig, on_run: OnRun | None = None) -> BenchResult:
    """Run every request rate of ``config`` in turn; after each run, ``on_run`` gets the
    result so far (its last run is the one that just ended)."""
    paragraphs = config.corpus if config.corpus is not None else load_corpus_paragraphs()
    source = TextSource(config.tokenizer, paragraphs)
    model = config.model or await _first_model(config)
    client = _make_client(config, model)
    limit = _limiter(config.max_concurrency)
    runs = []
    try:
        warmup_failed = await _warmup(config, client, source, limit)
        async with httpx.AsyncClient(timeout=METRICS_TIMEOUT_S) as http:
            for index, rate in enumerate(config.request_rates):
                run = await _run_rate(config, client, http, rate, index, source, limit)
                runs.append(run)
                if on_run is not None:
                    on_run(BenchResult(config, model, tuple(runs), warmup_failed))
    finally:
        await client.aclose()
    return BenchResult(config, model, tuple(runs), warmup_failed)


def _make_client(config: BenchConfig, model: str) -> BenchClient:
    options = RequestOptions(
        model, config.temperature, config.ignore_eos, config.api_key, config.timeout_s
    )
    if config.backend == "grpc":
        from pdserve.bench.serve.grpc_client import GrpcClient  # grpc loads only when asked for

        return GrpcClient(config.grpc_target, options)
    connections = config.max_concurrency or max(config.num_prompts, config.warmup, 1)
    return OpenAIClient(config.base_url, options, connections)


async def _first_model(config: BenchConfig) -> str:
    client = _make_client(config, model="")
    try:
        ids = await client.model_ids()
    finally:
        await client.aclose()
    if not ids:
        raise ValueError("the server lists no models; pass --model")
    return ids[0]


def _limiter(max_concurrency: int | None) -> Any:
    if max_concurrency is None:
        return contextlib.nullcontext()
    return asyncio.Semaphore(max_concurrency)


async def _warmup(config: BenchConfig, client: BenchClient, source: TextSource, limit: Any) -> int:
    """Send ``config.warmup`` extra items at once; returns how many requests failed."""
    if config.warmup == 0:
        return 0
    items = build_dataset(config.dataset, config.warmup, config.seed + WARMUP_SEED_OFFSET, source)
    with _progress(config, items, "warmup") as bar:
        outputs, _ = await _drive(client, items, [0.0] * len(items), limit, bar)
    return sum(not o.success for o in outputs)


async def _run_rate(
    config: BenchConfig,
    client: BenchClient,
    http: httpx.AsyncClient,
    rate: float,
    index: int,
    source: TextSource,
    limit: Any,
) -> RateResult:
    seed = config.seed + index
    items = build_dataset(config.dataset, config.num_prompts, seed, source)
    offsets_s = arrival_offsets_s(len(items), rate, seed, config.burstiness)
    before = await _server_snapshot(config, http)
    with _progress(config, items, f"rate {rate:g}/s") as bar:
        outputs, duration_s = await _drive(client, items, offsets_s, limit, bar)
    after = await _server_snapshot(config, http)
    server = figures(before, after) if config.scrape_metrics else ServerFigures()
    summary = summarize(outputs, duration_s, config.slo)
    return RateResult(rate, summary, server, tuple(outputs))


async def _server_snapshot(config: BenchConfig, http: httpx.AsyncClient) -> dict[str, float]:
    if not config.scrape_metrics:
        return {}
    return await scrape(http, config.resolved_metrics_url)


def _progress(config: BenchConfig, items: list[Item], label: str) -> tqdm:
    return tqdm(total=count_requests(items), desc=label, disable=not config.show_progress)


async def _drive(
    client: BenchClient,
    items: Sequence[Item],
    offsets_s: Sequence[float],
    limit: Any,
    bar: tqdm,
) -> tuple[list[RequestOutput], float]:
    """Start each item at its offset from now; returns outputs (in item order) and the wall
    time from the first send to the last completion."""
    start_s = time.perf_counter()
    tasks = []
    for item, offset_s in zip(items, offsets_s, strict=True):
        delay_s = start_s + offset_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(_send_item(client, item, limit, bar)))
    results = await asyncio.gather(*tasks)
    return [out for outs in results for out in outs], time.perf_counter() - start_s


async def _send_item(
    client: BenchClient,
    item: Item,
    limit: Any,
    bar: tqdm,
) -> list[RequestOutput]:
    if isinstance(item, BenchRequest):
        async with limit:
            out = await client.send(item)
        bar.update(1)
        return [out]
    return await _send_conversation(client, item, limit, bar)


async def _send_conversation(
    client: BenchClient,
    conversation: Conversation,
    limit: Any,
    bar: tqdm,
) -> list[RequestOutput]:
    """Turns one after another, each resending the history with the replies received."""
    history: list[tuple[str, str]] = []
    outputs: list[RequestOutput] = []
    for turn in conversation.turns:
        if outputs and not outputs[-1].success:
            outputs.append(_skipped(turn, "skipped: an earlier turn of the conversation failed"))
        else:
            async with limit:  # held per turn, not per conversation, as a user would
                out = await client.send(turn, history)
            history += [("user", turn.prompt.text), ("assistant", out.generated_text)]
            outputs.append(out)
        bar.update(1)
    return outputs


def _skipped(turn: BenchRequest, reason: str) -> RequestOutput:
    nan = float("nan")
    now_s = time.perf_counter()
    return RequestOutput(False, turn.prompt.num_tokens, 0, nan, (), 0.0, now_s, error=reason)
