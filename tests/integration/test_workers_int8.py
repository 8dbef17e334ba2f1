"""Prefill workers -> a decode worker with an int8 KV pool, over real gRPC and real NIXL, in
separate processes (``--kv-cache-dtype int8``).

From a prefill worker with an int8 pool the blocks go as stored (int8 values and scales) and
the greedy tokens equal the offline engine's with an int8 pool. From a prefill worker with
an fp32 pool the sender quantizes the blocks to the decode pool's rows, and the tokens equal
the same hand-off between two engines in this process. Either way each block moves as int8:
the transfer report counts the int8 block's bytes. Each prefill worker gets prompts of its
own: the decode worker's prefix cache would otherwise serve one's blocks to the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.runner import bytes_per_block
from pdserve.engine.worker_state import LoadedModel
from tests.integration.test_engine_int8 import handoff_greedy
from tests.integration.worker_procs import (
    WorkerProc,
    greedy,
    launch_worker,
    run_disaggregated,
    running,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
WORKER_ARGS = ("--num-blocks", "64", "--kv-backend", "nixl", "--transfer-timeout-s", "10")
INT8 = ("--kv-cache-dtype", "int8")
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Write a haiku about the sea. Waves fold into foam, and the tide keeps its own slow "
    "count of the hours while gulls argue over the",
)


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProc]]:
    """Launched first so the workers load while this process builds its references."""
    tmp: Path = tmp_path_factory.mktemp("workers_int8")
    launched = [
        launch_worker("prefill-int8", "prefill", tmp, *WORKER_ARGS, *INT8),
        launch_worker("prefill-fp32", "prefill", tmp, *WORKER_ARGS),
        launch_worker("decode-int8", "decode", tmp, *WORKER_ARGS, *INT8),
    ]
    with running(launched) as workers:
        yield {w.name: w for w in workers}


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any) -> dict[str, list[list[int]]]:
    return {
        "prefill-int8": [smollm2_tokenizer.encode(p) for p in PROMPTS],
        "prefill-fp32": [smollm2_tokenizer.encode(f"Continue: {p}") for p in PROMPTS],
    }


@pytest.fixture(scope="module")
def loaded(default_model_source: Any, smollm2_model: Any, smollm2_tokenizer: Any) -> LoadedModel:
    return LoadedModel(default_model_source, smollm2_model, smollm2_tokenizer, "float32")


@pytest.mark.parametrize("prefill", ["prefill-int8", "prefill-fp32"])
def test_blocks_reach_the_int8_decode_worker_as_int8(
    procs: dict[str, WorkerProc],
    prompts: dict[str, list[list[int]]],
    loaded: LoadedModel,
    prefill: str,
) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    ours = prompts[prefill]
    if prefill == "prefill-int8":
        offline = LLM(loaded=loaded, kv_cache_dtype="int8", num_blocks=256)
        expected = [out.token_ids for out in offline.generate(ours, params)]
    else:
        expected = handoff_greedy(loaded, ours, "auto", params)
    block_bytes = bytes_per_block(loaded.model.config, 16, torch.int8)
    for i, prompt in enumerate(ours):
        result = run_disaggregated(
            procs[prefill], procs["decode-int8"], f"{prefill}-{i}", prompt, greedy(MAX_TOKENS)
        )
        assert result.token_ids == expected[i], (prefill, i)
        report = result.report
        assert report is not None and report.ok, report
        assert report.blocks_sent > 0 and report.bytes == report.blocks_sent * block_bytes
