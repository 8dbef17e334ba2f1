"""Decode steps whose layers run as one flat run of C calls (engine/model/native_step.py) give
the bits of the modules' path, logits and K/V alike, on one thread and on two; other steps
keep the modules."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pdserve.engine.model.fused_ops import fused_ops
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.native_step import NativeDecodeLayers
from pdserve.engine.model.packed_gemm import gemm_for
from pdserve.engine.runner import ModelRunner, allocate_kv_cache
from pdserve.engine.scheduler.plan import BatchPlan, ScheduledChunk

pytestmark = pytest.mark.slow

BLOCK_SIZE, STEPS = 16, 4
# 10 sequences of 17-44 tokens, in blocks of 16
PROMPTS = tuple([(7 * i + j) % 500 + 1 for j in range(17 + 3 * i)] for i in range(10))


@pytest.fixture(scope="module")
def bf16_model(default_model_source: Any) -> Any:
    return load_model(default_model_source, dtype=torch.bfloat16, show_progress=False)


@pytest.fixture()
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decode_steps_match_the_modules_bit_for_bit(
    smollm2_model: Any, bf16_model: Any, dtype: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = smollm2_model if dtype == "fp32" else bf16_model
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    if fused_ops() is None or gemm_for(torch_dtype) is None:
        pytest.skip(f"no C compiler or no {dtype} GEMM of ours here: the modules run every step")
    config = model.config
    cache = allocate_kv_cache(config, 5 * len(PROMPTS), BLOCK_SIZE, torch_dtype)
    runner = ModelRunner(config, model, cache, BLOCK_SIZE)
    native = model.native_layers
    assert isinstance(native, NativeDecodeLayers), "packed layers should run natively"
    runs: list[int] = []
    run = NativeDecodeLayers.run
    monkeypatch.setattr(
        NativeDecodeLayers, "run", lambda self, *a: (runs.append(1), run(self, *a))[1]
    )

    tables = [tuple(range(i * 5, i * 5 + 5)) for i in range(len(PROMPTS))]
    tokens = [list(p) for p in PROMPTS]
    prefill = [ScheduledChunk(str(i), tuple(p), 0, tables[i], True) for i, p in enumerate(PROMPTS)]
    logits = runner.execute(BatchPlan(tuple(prefill)))
    assert runs == [], "a step of prefill chunks went the native way"
    for _ in range(STEPS):
        for seq, row in zip(tokens, logits, strict=True):
            seq.append(int(row.argmax()))
        step = BatchPlan(
            tuple(
                ScheduledChunk(str(i), (seq[-1],), len(seq) - 1, tables[i], True)
                for i, seq in enumerate(tokens)
            )
        )
        logits = runner.execute(step)
        pool_after_native = cache.clone()
        model.native_layers = None  # the same step again, through the modules
        through_modules = runner.execute(step)
        model.native_layers = native
        assert torch.equal(logits, through_modules)
        assert torch.equal(cache, pool_after_native), "the K/V written differ"
    assert len(runs) == STEPS
