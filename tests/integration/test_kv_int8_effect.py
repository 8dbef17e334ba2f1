"""int8 KV transfer moves the output no more than its error bound allows: a tiny
bench/int8_effect.py (2 prompts x 8 tokens, the real model).

The tolerance, reasoned. ``kv_transfer/quant.py`` rounds every element to a multiple of its
(block, layer, K/V) slice's scale ``absmax / 127``: the error is at most ``e = absmax / 254``
and spreads about evenly over ``[-e, e]``. The reference perturbation puts every element
exactly ``e`` away, with a random sign. To first order the logits move by ``J @ err``; for
errors independent across elements the spread of that sum is proportional to the errors'
RMS, ``e / sqrt(3)`` for rounding and ``e`` for the reference, so int8 should move the
logits about 0.58x as much as the reference does. The test allows up to 1x: a sqrt(3) margin
for taking a max over the vocabulary and for rounding errors not being quite independent.
Quantization that broke the per-slice scales (a wrong axis, a lost or stale scale) makes
errors far larger than ``e`` and fails it; a transfer that skipped quantization fails the
``> 0`` side. The fp transfer must be exact: the decode engine's first step equals the
prefill engine's own next step on its own KV, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from bench.int8_effect import Continuation, Int8Effect, LogitsTap, compare
from engine.sampling_params import SamplingParams
from engine.worker_state import LoadedModel

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
TEXTS = (
    "The lighthouse keeper climbed the stairs each evening, lit the lamp, and wrote the "
    "names of the ships that passed into a worn leather book. On stormy nights he counted "
    "the seconds between the flashes of the",
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] "
    "< b[0] else b.pop(0))\n    return out + a + b\n\n# merge two sorted lists, then",
)
# Per element of the fp32 wire record: one int8 value, plus one f32 scale per (layer, K/V)
# per block -- 240 bytes against the block's 737,280 (quant.py's record format).
INT8_BYTES_PER_FP32_BYTE = 0.25


@pytest.fixture(scope="module")
def effect(
    default_model_source: Any, smollm2_model: Any, smollm2_tokenizer: Any
) -> Iterator[Int8Effect]:
    loaded = LoadedModel(default_model_source, smollm2_model, smollm2_tokenizer, "float32")
    bench = Int8Effect(loaded, num_blocks=24)
    yield bench
    bench.close()


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any) -> list[list[int]]:
    ids = [list(smollm2_tokenizer.encode(t, add_special_tokens=False)) for t in TEXTS]
    assert all(len(p) > 32 and len(p) % 16 for p in ids), "several blocks, the last partial"
    return ids


@pytest.fixture(scope="module")
def prefill_tap(effect: Int8Effect) -> LogitsTap:
    return LogitsTap(effect.prefill_engine)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _tokens(outputs: list[Any]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def _colocated(
    effect: Int8Effect, tap: LogitsTap, request_id: str, prompt: list[int]
) -> Continuation:
    """The prefill engine continuing on its own KV: no transfer at all."""
    engine = effect.prefill_engine
    engine.add_request(request_id, prompt, _greedy(MAX_TOKENS + 1))
    tokens = _tokens(engine.step())  # the whole prompt fits one step: the first token
    assert len(tokens) == 1, tokens
    tap.arm()
    while engine.has_unfinished():
        tokens += _tokens(engine.step())
    assert tap.logits is not None and len(tokens) == MAX_TOKENS + 1
    return Continuation(tuple(tokens[1:]), tap.logits, 0)


def _bound_perturbed(
    effect: Int8Effect, request_id: str, prompt: list[int], first: int, seed: int
) -> Continuation:
    """An fp transfer, then every received element moved by +-absmax/254 of its slice."""
    seq_id = f"{request_id}-bound"
    block_ids, _ = effect.import_kv(request_id, seq_id, prompt, int8=False)
    pool = effect.decode_engine.runner.kv_cache  # [blocks, layers, 2, block_size, heads, dim]
    index = torch.tensor(block_ids, dtype=torch.long)
    blocks = pool.index_select(0, index)
    absmax = blocks.abs().amax(dim=(3, 4, 5), keepdim=True)  # [n, layers, 2, 1, 1, 1]
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, blocks.shape, generator=generator).to(blocks.dtype) * 2 - 1
    pool.index_copy_(0, index, blocks + signs * absmax / 254)
    return effect.decode(seq_id, prompt, first, MAX_TOKENS)


def test_fp_transfer_continues_exactly_like_the_engine_on_its_own_kv(
    effect: Int8Effect, prefill_tap: LogitsTap, prompts: list[list[int]]
) -> None:
    for i, prompt in enumerate(prompts):
        reference = _colocated(effect, prefill_tap, f"coloc-{i}", prompt)
        first = effect.prefill(f"fp-{i}", prompt, MAX_TOKENS)
        try:
            fp = effect.continue_after_transfer(f"fp-{i}", prompt, first, MAX_TOKENS, int8=False)
        finally:
            effect.prefill_engine.release(f"fp-{i}")
        assert fp.token_ids == reference.token_ids
        assert torch.equal(fp.first_step_logits, reference.first_step_logits)


def test_int8_moves_the_logits_less_than_its_error_bound_would(
    effect: Int8Effect, prompts: list[list[int]]
) -> None:
    for i, prompt in enumerate(prompts):
        request_id = f"int8-{i}"
        first = effect.prefill(request_id, prompt, MAX_TOKENS)
        try:
            fp = effect.continue_after_transfer(request_id, prompt, first, MAX_TOKENS, int8=False)
            int8 = effect.continue_after_transfer(request_id, prompt, first, MAX_TOKENS, int8=True)
            bound = _bound_perturbed(effect, request_id, prompt, first, seed=i)
        finally:
            effect.prefill_engine.release(request_id)
        result = compare(len(prompt), fp, int8)
        bound_diff = (bound.first_step_logits - fp.first_step_logits).abs().max().item()
        assert 0 < result.max_abs_logit_diff <= bound_diff, (result, bound_diff)
        assert result.int8_bytes / result.fp_bytes == pytest.approx(
            INT8_BYTES_PER_FP32_BYTE, abs=1e-3
        )
        assert result.decoded_tokens == MAX_TOKENS
        assert result.agree_prefix_tokens <= result.agree_tokens <= MAX_TOKENS
