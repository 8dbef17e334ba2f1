"""The benchmark workload (determinism, exact lengths in range), the floor's ideal
schedule (token conservation, a hand-worked example) and its roofline readings. A
byte-level tokenizer stands in for the model tokenizer, so no model is loaded."""

from __future__ import annotations

import pytest

from pdserve.bench.engine_throughput import compute_floor, format_table
from pdserve.bench.floor import (
    ModelShape,
    Roofline,
    StepShape,
    best_reading,
    simulate_schedule,
    step_floor_s,
)
from pdserve.bench.workload import (
    RunResult,
    WorkloadSpec,
    build_workload,
    cap_output_tokens,
    load_paragraphs,
)


def _byte_tokenize(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def paragraphs() -> list[str]:
    return load_paragraphs()


def test_workload_is_deterministic_and_lengths_are_in_range(paragraphs: list[str]) -> None:
    spec = WorkloadSpec()
    first = build_workload(_byte_tokenize, spec, paragraphs)
    again = build_workload(_byte_tokenize, spec, paragraphs)
    assert first == again
    assert len(first) == 64
    prompt_lengths = [len(p) for p, _ in first]
    output_lengths = [o for _, o in first]
    assert all(32 <= n <= 1024 for n in prompt_lengths)
    assert all(16 <= n <= 512 for n in output_lengths)
    # "uniform-ish": the draws spread over the range rather than bunching up
    assert min(prompt_lengths) < 300 and max(prompt_lengths) > 750
    assert min(output_lengths) < 150 and max(output_lengths) > 380


def test_prompts_are_real_corpus_text_without_shared_prefixes(paragraphs: list[str]) -> None:
    workload = build_workload(_byte_tokenize, WorkloadSpec(), paragraphs)
    heads = {bytes(prompt[:32]) for prompt, _ in workload}
    assert len(heads) == len(workload), "two prompts start with the same 32 tokens"
    corpus = "\n\n".join(paragraphs).encode("utf-8")
    for prompt, _ in workload[:8]:
        assert bytes(prompt[:32]) in corpus


def test_smaller_workload_is_a_prefix_and_seed_changes_it(paragraphs: list[str]) -> None:
    full = build_workload(_byte_tokenize, WorkloadSpec(), paragraphs)
    small = build_workload(_byte_tokenize, WorkloadSpec(num_requests=4), paragraphs)
    other = build_workload(_byte_tokenize, WorkloadSpec(seed=1), paragraphs)
    assert small == full[:4]
    assert other != full
    capped = cap_output_tokens(small, 8)
    assert [o for _, o in capped] == [min(o, 8) for _, o in small]
    assert [p for p, _ in capped] == [p for p, _ in small]


def test_bad_specs_are_value_errors(paragraphs: list[str]) -> None:
    with pytest.raises(ValueError, match="min_prompt_tokens"):
        WorkloadSpec(min_prompt_tokens=100, max_prompt_tokens=10)
    with pytest.raises(ValueError, match="paragraph starts"):
        build_workload(_byte_tokenize, WorkloadSpec(num_requests=10_000), paragraphs)
    with pytest.raises(ValueError, match="max_output"):
        cap_output_tokens([((1,), 5)], 0)


def test_ideal_schedule_conserves_tokens() -> None:
    lengths = [(700, 5), (1500, 1), (40, 30), (900, 12)]
    steps = simulate_schedule(lengths, token_budget=512, max_seqs=2)
    assert all(s.num_tokens <= 512 for s in steps)
    assert sum(s.num_sampled for s in steps) == sum(o for _, o in lengths)
    # every prompt token once, then every output token but the last is fed back once
    assert sum(s.num_tokens for s in steps) == sum(p + o - 1 for p, o in lengths)


def test_ideal_schedule_hand_worked() -> None:
    # budget 8: step 1 prefills 8 of A's 10; step 2 finishes A (2 tokens, samples) and 6 of
    # B; step 3 decodes A (context 10 cached) and finishes B's last token (samples); done.
    steps = simulate_schedule([(10, 2), (7, 1)], token_budget=8, max_seqs=4)
    assert steps == [
        StepShape(num_tokens=8, attended_context_tokens=36, num_sampled=0, kv_read_tokens=0),
        StepShape(
            num_tokens=8, attended_context_tokens=(9 + 10) + 21, num_sampled=1, kv_read_tokens=8
        ),
        StepShape(
            num_tokens=2, attended_context_tokens=11 + 7, num_sampled=2, kv_read_tokens=10 + 6
        ),
    ]


def test_step_floor_is_bandwidth_bound_for_decode_and_compute_bound_for_prefill() -> None:
    model, roof = ModelShape(), Roofline(memory_bandwidth_gb_s=10.0, matmul_gflop_s=100.0)
    decode = StepShape(num_tokens=1, attended_context_tokens=100, num_sampled=1, kv_read_tokens=99)
    weights_bytes = (model.num_layers * model.layer_params + model.lm_head_params) * 4
    kv_bytes = 100 * model.kv_bytes_per_token(4)
    assert step_floor_s(decode, model, roof, 4) == pytest.approx((weights_bytes + kv_bytes) / 10e9)
    prefill = StepShape(num_tokens=2048, attended_context_tokens=2048 * 2049 // 2)
    linear_flops = 2 * 2048 * model.num_layers * model.layer_params
    assert step_floor_s(prefill, model, roof, 4) > linear_flops / 100e9
    # SmolLM2-135M: 30 layers of ~3.54M linear weights, 28.3M tied embedding/LM head
    assert model.num_layers * model.layer_params + model.lm_head_params == pytest.approx(
        134.5e6, rel=0.01
    )


def test_floor_takes_each_roofline_quantity_at_its_best_reading() -> None:
    before = Roofline(memory_bandwidth_gb_s=30.0, matmul_gflop_s=400.0)
    after = Roofline(memory_bandwidth_gb_s=36.0, matmul_gflop_s=350.0)
    assert best_reading([before, after]) == Roofline(36.0, 400.0)
    workload = [((1,) * 100, 20), ((2,) * 300, 5)]
    both = compute_floor(workload, "fp32", 2048, 64, [before, after])
    alone = compute_floor(workload, "fp32", 2048, 64, [before])
    assert both.readings == (before, after) and both.roofline == Roofline(36.0, 400.0)
    assert both.wall_s < alone.wall_s  # the faster reading only lowers the floor
    ours = RunResult(
        "pdserve", prompt_tokens=400, output_tokens=25, wall_s=3 * both.wall_s, peak_rss_bytes=0
    )
    table = format_table({"pdserve": ours}, both, "fp32")
    assert "roofline read before the runs: memory 30.0 GB/s, matmul 400 GFLOP/s" in table
    assert "roofline read after them: memory 36.0 GB/s, matmul 350 GFLOP/s" in table
    assert "pdserve wall / floor: 3.00x" in table
