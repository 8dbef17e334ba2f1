"""Prefill worker -> decode worker with the TCP KV backend (the fallback where NIXL is
missing): greedy outputs equal the offline engine and transformers, prefix hits included.
The workers hold a cluster secret, as `pdserve up` runs them: mutual TLS on gRPC, and the KV
connection handshake before every transfer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.worker.cluster_secret import ClusterSecret
from tests.integration.worker_procs import (
    WorkerProc,
    greedy,
    launch_worker,
    offline_llm,
    run_disaggregated,
    running,
    wait_for,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
ARGS = ("--num-blocks", "64", "--kv-backend", "tcp")
PREFIX = "Recipe notes. Bread: flour, water, salt and yeast; knead, rest, shape and bake hot. "
PROMPTS = (
    PREFIX + "Soup: onions, stock and",
    PREFIX + "Pancakes: eggs, milk and",
    "The three primary colours are",
)


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProc]]:
    tmp: Path = tmp_path_factory.mktemp("workers_tcp")
    secret = ClusterSecret.generate()
    launched = [
        launch_worker("prefill-tcp", "prefill", tmp, *ARGS, secret=secret),
        launch_worker("decode-tcp", "decode", tmp, *ARGS, secret=secret),
    ]
    with running(launched) as started:
        yield {w.role: w for w in started}


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any) -> list[list[int]]:
    return [smollm2_tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def references(hf_smollm2: Any, prompts: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """(offline engine, transformers) greedy tokens per prompt."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    offline = [out.token_ids for out in offline_llm().generate(prompts, params)]
    out = []
    with torch.inference_mode():
        for ids, ours in zip(prompts, offline, strict=True):
            hf = hf_smollm2.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False
            )
            out.append((ours, hf[0, len(ids) :].tolist()))
    return out


def test_tcp_disaggregated_greedy_equals_references(
    workers: dict[str, WorkerProc],
    prompts: list[list[int]],
    references: list[tuple[list[int], list[int]]],
) -> None:
    prefill, decode = workers["prefill"], workers["decode"]
    results = [
        run_disaggregated(prefill, decode, f"tcp-{i}", ids, greedy(MAX_TOKENS))
        for i, ids in enumerate(prompts)
    ]
    for i, (result, (offline, hf)) in enumerate(zip(results, references, strict=True)):
        assert result.token_ids == offline == hf, f"prompt {i}"
        assert result.report is not None and result.report.ok, result.report
    # The shared recipe prefix is cached on the decode worker for the second prompt.
    second = results[1]
    assert second.destination.num_present_blocks >= 1
    assert second.report is not None
    assert second.report.blocks_sent == len(second.destination.block_ids) - (
        second.destination.num_present_blocks
    )
    for worker in (prefill, decode):
        assert wait_for(lambda w=worker: w.stats().free_blocks == 64)
        stats = worker.stats()
        assert stats.transfers_ok == 3 and stats.transfers_failed == 0


def test_sigterm_stops_a_worker_gracefully(workers: dict[str, WorkerProc]) -> None:
    """Runs last in this module: the decode worker exits 0 and says so in its log."""
    decode = workers["decode"]
    assert decode.stop() == 0
    assert f"worker {decode.name} stopped" in decode.log_tail()
