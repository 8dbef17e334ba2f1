"""bench/step_profile.py: the shape, kind and per-kind totals of steps the engine ran."""

from __future__ import annotations

from bench.floor import StepShape
from bench.step_profile import step_kind, step_shape, summarize
from engine.scheduler.plan import BatchPlan, ScheduledChunk


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
    totals = summarize(records, lambda shape: 0.1 * shape.num_tokens)
    assert list(totals) == ["decode B<=16", "prefill"]
    assert (totals["decode B<=16"].steps, totals["decode B<=16"].engine_s) == (2, 1.5)
    assert abs(totals["decode B<=16"].floor_s - 0.2) < 1e-12
    assert (totals["prefill"].tokens, abs(totals["prefill"].floor_s - 0.6) < 1e-12) == (6, True)
