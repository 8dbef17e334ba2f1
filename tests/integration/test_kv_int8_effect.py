"""int8 KV transfer moves the output no more than its error bound allows: a tiny
bench/int8_effect.py (2 prompts x 8 tokens, the real model).

The tolerance, reasoned. ``kv_transfer/quant.py`` rounds every element to a multiple of its
group's scale ``s``: K groups are (block, layer, kv_head, channel) over the block's tokens,
V groups (block, layer, token, kv_head) over the channels, and ``s`` is the group's
``absmax / 127`` rounded up to bf16, so the error is at most ``e = (absmax / 254)(1 + 2^-7)``
and spreads about evenly over ``[-e, e]``. The reference perturbation puts every element
exactly its group's ``e`` away, with a random sign. To first order the logits move by
``J @ err``; for errors independent across elements the spread of that sum is proportional
to the errors' RMS, ``e / sqrt(3)`` for rounding and ``e`` for the reference, so int8 should
move the logits about 0.58x as much as the reference does. The test allows up to 1x: a
sqrt(3) margin for taking a max over the vocabulary and for rounding errors not being quite
independent (measured: int8 moves them 0.4-0.6x as much). A transfer that skipped
quantization fails the ``> 0`` side. Scales laid out wrongly make most errors far larger
than their group's ``e``, and the last test checks that the bound rejects two such layouts:
the retired one scale per (block, layer, K/V) slice (about 2x the bound on these prompts)
and quant.py's records with the K scales read in the wrong order (about 90x). The fp
transfer must be exact: the decode engine's first step equals the prefill engine's own next
step on its own KV, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch

from pdserve.bench.int8_effect import Continuation, Int8Effect, LogitsTap, compare
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.worker_state import LoadedModel
from pdserve.kv_transfer import KVPoolLayout, quant

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
TEXTS = (
    "The lighthouse keeper climbed the stairs each evening, lit the lamp, and wrote the "
    "names of the ships that passed into a worn leather book. On stormy nights he counted "
    "the seconds between the flashes of the",
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] "
    "< b[0] else b.pop(0))\n    return out + a + b\n\n# merge two sorted lists, then",
)
# One int8 record of the default model (quant.py's table: L=30, bs=16, H=3, D=64): bf16
# scales per K (layer, head, channel) and per V (layer, token, head), one int8 per element.
RECORD_SCALE_BYTES = 2 * 30 * 3 * (64 + 16)
RECORD_VALUE_BYTES = 30 * 2 * 16 * 3 * 64
INT8_BYTES_PER_FP32_BYTE = (RECORD_SCALE_BYTES + RECORD_VALUE_BYTES) / (4 * RECORD_VALUE_BYTES)
# Dims of a K or V half, [n, layers, block_size, kv_heads, head_dim], that a scale spans.
SCHEME_DIMS: dict[str, tuple[int, ...]] = {"K": (2,), "V": (4,)}
RETIRED_DIMS: dict[str, tuple[int, ...]] = {
    "K": (2, 3, 4),
    "V": (2, 3, 4),
}  # wire v1: one scale per (block, layer, K/V)


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


@dataclass(slots=True, frozen=True)
class PromptRuns:
    """One prompt continued after an fp transfer, an int8 one, the bound and wrong layouts."""

    prompt_tokens: int
    fp: Continuation
    int8: Continuation
    bound: Continuation
    wrong: dict[str, Continuation]  # by name in WRONG_LAYOUTS

    def logit_shift(self, other: Continuation) -> float:
        """max |logit difference| from the fp continuation at the first decode step."""
        return (other.first_step_logits - self.fp.first_step_logits).abs().max().item()


def _steps(blocks: torch.Tensor, dims: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """absmax / 127 of each element's group; K's and V's groups span ``dims``."""
    # blocks: [n, layers, 2, block_size, kv_heads, head_dim] -> the same shape
    k, v = blocks[:, :, 0].abs(), blocks[:, :, 1].abs()
    k_absmax = k.amax(dim=dims["K"], keepdim=True).expand_as(k)
    v_absmax = v.amax(dim=dims["V"], keepdim=True).expand_as(v)
    return torch.stack([k_absmax, v_absmax], dim=2) / 127


def _at_max_error(blocks: torch.Tensor, seed: int) -> torch.Tensor:
    """Every element moved by the scheme's largest error ``e`` of its group, random signs."""
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, blocks.shape, generator=generator).to(blocks.dtype) * 2 - 1
    return blocks + signs * _steps(blocks, SCHEME_DIMS) * (1 + 2**-7) / 2


def _int8_with_layout(blocks: torch.Tensor, dims: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """A round trip through symmetric int8 with f32 scales over ``dims`` (not quant.py's)."""
    steps = _steps(blocks, dims)
    safe = torch.where(steps > 0, steps, torch.ones_like(steps))
    return torch.div(blocks, safe).round_().clamp_(-127, 127) * steps


def _k_scales_misread(blocks: torch.Tensor) -> torch.Tensor:
    """quant.py's records, decoded by a receiver that reads the K scales as [layers,
    head_dim, kv_heads] instead of [layers, kv_heads, head_dim]."""
    n, layers, _, block_size, heads, dim = blocks.shape
    layout = KVPoolLayout(n, layers, block_size, heads, dim, blocks.dtype)
    records = quant.encode_records(blocks, layout)  # [n, record_bytes] uint8
    k_bytes = 2 * layers * heads * dim  # bf16 K scales lead the record
    k_scales = records[:, :k_bytes].contiguous().view(torch.bfloat16).reshape(n, layers, heads, dim)
    records[:, :k_bytes] = k_scales.transpose(2, 3).contiguous().view(torch.uint8).reshape(n, -1)
    out = torch.empty_like(blocks)
    quant.decode_records_into(records, out, list(range(n)), layout)
    return out


WRONG_LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "one scale per (block, layer, K/V) slice": partial(_int8_with_layout, dims=RETIRED_DIMS),
    "K scales read as [layers, head_dim, kv_heads]": _k_scales_misread,
}


def _changed(
    effect: Int8Effect,
    request_id: str,
    prompt: list[int],
    first: int,
    tag: str,
    change: Callable[[torch.Tensor], torch.Tensor],
) -> Continuation:
    """An fp transfer, then every received block replaced by ``change(block)``."""
    seq_id = f"{request_id}-{tag}"
    block_ids, _ = effect.import_kv(request_id, seq_id, prompt, int8=False)
    pool = effect.decode_engine.runner.kv_cache  # [blocks, layers, 2, block_size, heads, dim]
    index = torch.tensor(block_ids, dtype=torch.long)
    pool.index_copy_(0, index, change(pool.index_select(0, index)))
    return effect.decode(seq_id, prompt, first, MAX_TOKENS)


def _run_prompt(effect: Int8Effect, i: int, prompt: list[int]) -> PromptRuns:
    request_id = f"int8-{i}"
    first = effect.prefill(request_id, prompt, MAX_TOKENS)
    try:
        fp = effect.continue_after_transfer(request_id, prompt, first, MAX_TOKENS, int8=False)
        int8 = effect.continue_after_transfer(request_id, prompt, first, MAX_TOKENS, int8=True)
        bound = _changed(effect, request_id, prompt, first, "bound", partial(_at_max_error, seed=i))
        wrong = {
            name: _changed(effect, request_id, prompt, first, f"wrong{j}", change)
            for j, (name, change) in enumerate(WRONG_LAYOUTS.items())
        }
    finally:
        effect.prefill_engine.release(request_id)
    return PromptRuns(len(prompt), fp, int8, bound, wrong)


@pytest.fixture(scope="module")
def runs(effect: Int8Effect, prompts: list[list[int]]) -> list[PromptRuns]:
    return [_run_prompt(effect, i, prompt) for i, prompt in enumerate(prompts)]


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


def test_int8_moves_the_logits_less_than_its_error_bound_would(runs: list[PromptRuns]) -> None:
    for run in runs:
        result = compare(run.prompt_tokens, run.fp, run.int8)
        bound_shift = run.logit_shift(run.bound)
        assert 0 < result.max_abs_logit_diff <= bound_shift, (result, bound_shift)
        assert result.int8_bytes / result.fp_bytes == pytest.approx(
            INT8_BYTES_PER_FP32_BYTE, abs=1e-4
        )
        assert result.decoded_tokens == MAX_TOKENS
        assert result.agree_prefix_tokens <= result.agree_tokens <= MAX_TOKENS


def test_the_bound_rejects_wrongly_laid_out_scales(runs: list[PromptRuns]) -> None:
    for run in runs:
        bound_shift = run.logit_shift(run.bound)
        shifts = {name: run.logit_shift(c) for name, c in run.wrong.items()}
        assert all(shift > bound_shift for shift in shifts.values()), (bound_shift, shifts)
