"""bench/step_profile.py: the shape, kind and per-kind totals of steps the engine ran."""

from __future__ import annotations

import math

from pdserve.bench.floor import StepShape
from pdserve.bench.step_profile import step_kind, step_shape, summarize
from pdserve.engine.scheduler.plan import BatchPlan, ScheduledChunk


def _chunk(start: int, tokens: int, sample: bool = True) -> ScheduledChunk:
    return ScheduledChunk(f"s{start}", tuple(range(tokens)), start, (0,), sample)


def test_step_shape_counts_attention_and_kv_read_per_chunk() -> None:
    # a decode at position 10 (attends to 11 positions, reads 10), and a 4-token chunk after
    # 8 cached positions (attends to 9 + 10 + 11 + 12 = 42, reads 8) that does not sample
    plan = BatchPlan(chunks=(_chunk(10, 1), _chunk(8, 4, sample=False)))
    assert step_shape(plan) == StepShape(
        num_tokens=5, attended_context_tokens=53, num_sampled=1, kv_read_tokens=18
    )


def test_step_kind_buckets_decodes_by_batch_size() -> None:
    assert step_kind(BatchPlan(chunks=tuple(_chunk(5, 1) for _ in range(16)))) == "decode B<=16"
    assert step_kind(BatchPlan(chunks=tuple(_chunk(5, 1) for _ in range(17)))) == "decode B<=32"
    assert step_kind(BatchPlan(chunks=(_chunk(0, 7),))) == "prefill"
    assert step_kind(BatchPlan(chunks=(_chunk(5, 1), _chunk(0, 7)))) == "mixed"


def test_summarize_adds_engine_and_floor_seconds_per_kind() -> None:
    decode, prefill = BatchPlan(chunks=(_chunk(3, 1),)), BatchPlan(chunks=(_chunk(0, 6),))
    records = [(0.5, decode), (0.25, prefill), (1.0, decode)]
    # memory 0.1 s and compute 0.3 s per token: floor 0.3, serial floor 0.4 per token
    totals = summarize(records, lambda shape: (0.1 * shape.num_tokens, 0.3 * shape.num_tokens))
    assert list(totals) == ["decode B<=16", "prefill"]
    decodes, prefills = totals["decode B<=16"], totals["prefill"]
    assert (decodes.steps, decodes.engine_s, decodes.tokens) == (2, 1.5, 2)
    assert math.isclose(decodes.floor_s, 0.6) and math.isclose(decodes.serial_s, 0.8)
    assert (prefills.steps, prefills.tokens) == (1, 6)
    assert math.isclose(prefills.floor_s, 1.8) and math.isclose(prefills.serial_s, 2.4)
