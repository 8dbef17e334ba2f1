"""Sampler tests: greedy and truncation against argmax, penalties and warpers against
Hugging Face's logits processors, seed reproducibility across batches, and the sampled
distribution against the softmax."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pdserve.engine.sampler import Sampler, SampleRequest, derive_step_seed
from pdserve.engine.sampling_params import SamplingParams

VOCAB = 64


def _req(
    prompt: tuple[int, ...] = (1, 2, 3),
    output: tuple[int, ...] | range = (),
    salt: int = 0,
    **params: object,
) -> SampleRequest:
    return SampleRequest(SamplingParams(**params), prompt, output, salt)  # type: ignore[arg-type]


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


def _all_logprobs(sampler: Sampler, logits: torch.Tensor, req: SampleRequest) -> torch.Tensor:
    """The processed distribution of a 1-row batch as a dense [vocab] tensor (-inf = cut)."""
    assert logits.shape[1] <= 20, "logprobs returns at most 20 alternatives"
    result = sampler(logits, [req])[0]
    dense = torch.full((logits.shape[1],), -math.inf)
    for token_id, logprob in result.top_logprobs:
        dense[token_id] = logprob
    return dense


def test_greedy_is_argmax_on_fast_and_slow_paths() -> None:
    logits = _logits(8)
    expected = logits.argmax(dim=-1).tolist()
    fast = Sampler()(logits, [_req(temperature=0.0) for _ in range(8)])
    # logprobs on one row forces the general path for the whole batch.
    slow = Sampler()(
        logits, [_req(temperature=0.0, logprobs=2 if i == 3 else None) for i in range(8)]
    )
    assert [r.token_id for r in fast] == expected
    assert [r.token_id for r in slow] == expected
    assert fast[0].logprob is None and fast[0].top_logprobs == ()


def test_greedy_ties_take_the_first_maximal_token_on_both_paths() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[0, [9, 5, 40]] = 2.0  # the first maximal index is 5
    logits[1, 30:] = 1.0
    fast = Sampler()(logits, [_req(temperature=0.0), _req(temperature=0.0)])
    slow = Sampler()(logits, [_req(temperature=0.0, logprobs=1), _req(temperature=0.0)])
    assert [r.token_id for r in fast] == [5, 30] == [r.token_id for r in slow]


def test_greedy_does_not_modify_callers_logits() -> None:
    logits = _logits(2)
    before = logits.clone()
    Sampler()(logits, [_req(temperature=0.0, repetition_penalty=2.0), _req(temperature=0.7)])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_top_k_one_and_tiny_top_p_are_greedy(temperature: float) -> None:
    logits = _logits(16, seed=1)
    expected = logits.argmax(dim=-1).tolist()
    sampler = Sampler(seed=3)
    top_k = sampler(logits, [_req(temperature=temperature, top_k=1) for _ in range(16)])
    top_p = sampler(logits, [_req(temperature=temperature, top_p=1e-6) for _ in range(16)])
    seeded = sampler(logits, [_req(temperature=temperature, top_k=1, seed=i) for i in range(16)])
    assert [r.token_id for r in top_k] == expected
    assert [r.token_id for r in top_p] == expected
    assert [r.token_id for r in seeded] == expected


def test_min_p_keeps_only_tokens_above_the_scaled_max() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    sampler = Sampler(seed=0)
    # threshold = 0.35 * 0.5 = 0.175: tokens 2 and 3 are cut, 0 and 1 renormalise to 5/8, 3/8.
    req = _req(min_p=0.35, logprobs=4)
    drawn = {sampler(logits, [req])[0].token_id for _ in range(200)}
    assert drawn == {0, 1}
    dense = _all_logprobs(sampler, logits, req)
    assert torch.allclose(dense[:2].exp(), torch.tensor([5 / 8, 3 / 8]), atol=1e-6)
    assert torch.isinf(dense[2:]).all()


def test_warpers_match_hugging_face() -> None:
    logits = _logits(1, vocab=20, seed=5)
    ids = torch.tensor([[1, 2, 3]])
    cases: list[tuple[SamplingParams, list[LogitsProcessor]]] = [
        (
            SamplingParams(temperature=0.8, top_k=5),
            [TemperatureLogitsWarper(0.8), TopKLogitsWarper(5)],
        ),
        (
            SamplingParams(temperature=1.3, top_p=0.6),
            [TemperatureLogitsWarper(1.3), TopPLogitsWarper(0.6)],
        ),
        (SamplingParams(temperature=1.0, min_p=0.2), [MinPLogitsWarper(0.2)]),
        (
            SamplingParams(temperature=0.9, top_k=8, top_p=0.9),
            [TemperatureLogitsWarper(0.9), TopKLogitsWarper(8), TopPLogitsWarper(0.9)],
        ),
    ]
    for params, warpers in cases:
        reference = logits.clone()
        for warper in warpers:
            reference = warper(ids, reference)
        req = SampleRequest(replace(params, logprobs=20), (1, 2, 3), ())
        dense = _all_logprobs(Sampler(), logits, req)
        expected = reference.log_softmax(dim=-1)[0]
        kept = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(dense), kept), params
        assert torch.allclose(dense[kept], expected[kept], atol=1e-5), params


def test_repetition_penalty_matches_hugging_face() -> None:
    logits = _logits(1, vocab=20, seed=6)
    logits[0, 4], logits[0, 9] = 2.0, -1.0  # one positive and one negative seen token
    prompt, output = (4, 7, 7), (9, 12)
    reference = RepetitionPenaltyLogitsProcessor(1.7)(
        torch.tensor([[*prompt, *output]]), logits.clone()
    )
    req = _req(prompt=prompt, output=output, temperature=0.0, repetition_penalty=1.7, logprobs=20)
    dense = _all_logprobs(Sampler(), logits, req)
    assert torch.allclose(dense, reference.log_softmax(dim=-1)[0], atol=1e-5)
    # and by hand, the two tokens whose sign matters
    penalised = logits.clone()
    penalised[0, 4], penalised[0, 9] = 2.0 / 1.7, -1.0 * 1.7
    penalised[0, 7], penalised[0, 12] = (
        _hf_penalty(logits[0, 7], 1.7),
        _hf_penalty(logits[0, 12], 1.7),
    )
    assert torch.allclose(dense, penalised.log_softmax(dim=-1)[0], atol=1e-5)


def _hf_penalty(value: torch.Tensor, penalty: float) -> float:
    return float(value / penalty) if value > 0 else float(value * penalty)


def test_presence_and_frequency_penalties_subtract_per_output_token() -> None:
    logits = _logits(1, vocab=20, seed=7)
    # token 3 twice, token 5 once in the output; token 8 only in the prompt is untouched.
    req = _req(
        prompt=(8,),
        output=(3, 5, 3),
        temperature=0.0,
        presence_penalty=0.25,
        frequency_penalty=0.5,
        logprobs=20,
    )
    expected = logits.clone()
    expected[0, 3] -= 2 * 0.5 + 0.25
    expected[0, 5] -= 1 * 0.5 + 0.25
    dense = _all_logprobs(Sampler(), logits, req)
    assert torch.allclose(dense, expected.log_softmax(dim=-1)[0], atol=1e-5)


def test_penalty_token_out_of_vocab_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="token ids must be in"):
        Sampler()(_logits(1), [_req(prompt=(VOCAB,), repetition_penalty=1.2)])


def test_logits_shape_mismatch_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="got shape"):
        Sampler()(_logits(2), [_req()])


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    """Token i depends on (seed, salt, i) only: batch position, neighbours and the Sampler
    instance (a prefill worker's vs a decode worker's) do not matter."""
    vocab, steps = 1000, 12
    row_logits = [_logits(1, vocab=vocab, seed=100 + i) for i in range(steps)]

    def run(sampler: Sampler, step: int, position: int, batch: int) -> int:
        logits = _logits(batch, vocab=vocab, seed=step * 7 + batch)
        logits[position] = row_logits[step][0]
        reqs = [_req(temperature=0.9, seed=None if j % 2 else j + 1000) for j in range(batch)]
        reqs[position] = _req(output=tuple(range(step)), temperature=0.9, top_p=0.95, seed=42)
        return sampler(logits, reqs)[position].token_id

    alone = [run(Sampler(), s, 0, 1) for s in range(steps)]
    prefill, decode = Sampler(seed=1), Sampler(seed=2)
    split = [run(prefill, 0, 3, 5)] + [run(decode, s, s % 4, 4 + s % 3) for s in range(1, steps)]
    assert alone == split
    assert len(set(alone)) > 1, "a flat-ish distribution over 1000 tokens should vary by step"


def test_different_seeds_and_salts_differ() -> None:
    logits = torch.zeros(1, 1000)  # uniform: every draw is pure noise

    def sequence(seed: int, salt: int) -> list[int]:
        sampler = Sampler()
        reqs = [_req(output=range(step), salt=salt, seed=seed) for step in range(16)]
        return [sampler(logits, [r])[0].token_id for r in reqs]

    assert sequence(1, 0) == sequence(1, 0)
    assert sequence(1, 0) != sequence(2, 0)
    assert sequence(1, 0) != sequence(1, 1)
    assert derive_step_seed(1, 0, 5) != derive_step_seed(1, 0, 6)
    assert 0 <= derive_step_seed(-3, 2**70, 0) < 2**63


def test_logprobs_sum_to_one_and_are_ordered() -> None:
    logits = _logits(3, vocab=12, seed=9)
    reqs = [
        _req(temperature=0.7, logprobs=12, seed=4),
        _req(temperature=0.0, logprobs=12),
        _req(temperature=1.0, logprobs=3, seed=5),
    ]
    results = Sampler()(logits, reqs)
    for result in results[:2]:
        values = [lp for _, lp in result.top_logprobs]
        assert math.isclose(sum(math.exp(v) for v in values), 1.0, rel_tol=1e-5)
    for result in results:
        values = [lp for _, lp in result.top_logprobs]
        assert values == sorted(values, reverse=True)
        chosen = dict(result.top_logprobs).get(result.token_id)
        assert chosen is None or math.isclose(chosen, result.logprob or 0.0, abs_tol=1e-6)
    assert len(results[2].top_logprobs) == 3
    expected = (logits[1] / 1.0).log_softmax(dim=-1)
    assert results[1].token_id == int(logits[1].argmax())
    assert math.isclose(results[1].logprob or 0.0, float(expected.max()), abs_tol=1e-6)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_distribution_matches_softmax(seeded: bool) -> None:
    vocab, draws, temperature = 8, 4000, 0.8
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 0.3, -1.0, 1.2]])
    reqs = [
        _req(output=range(i), temperature=temperature, seed=11 if seeded else None)
        for i in range(draws)
    ]
    results = Sampler(seed=0)(logits.expand(draws, vocab), reqs)
    counts = torch.bincount(torch.tensor([r.token_id for r in results]), minlength=vocab)
    # 7 degrees of freedom: P(chi2 > 30) is about 1e-4 for a correct sampler.
    assert _chi_square(counts.float(), (logits[0] / temperature).softmax(dim=-1)) < 30.0
