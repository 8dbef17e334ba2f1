"""Packed linears (our fp32 GEMM, our bf16 AMX or AVX-512 BF16 GEMM, oneDNN's) and the fused
MLP against plain torch ops; packing a model in place; the KV pool on huge pages; the heap
that keeps freed activations."""

from __future__ import annotations

import resource

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdserve.engine.model.packed_gemm as packed_gemm
import pdserve.engine.model.packed_linear as packed_linear
from pdserve.engine.attention import get_backend, layout_chunks, token_positions
from pdserve.engine.host_memory import (
    advise_huge_pages,
    keep_freed_memory,
    on_huge_pages,
    release_free_heap,
)
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.llama import LlamaModel
from pdserve.engine.model.packed_gemm import gemm_for, load_packed_gemm, swiglu_rows
from pdserve.engine.model.packed_linear import PackedLinear, PackedMLP, can_pack, project_add
from pdserve.engine.runner import allocate_kv_cache, kv_cache_shape
from pdserve.engine.scheduler.plan import ScheduledChunk

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(params=["native", "onednn"])
def gemm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which GEMMs pack weights: ours (packed_gemm.c for fp32; for bf16 amx_gemm.c where
    this CPU has AMX, else avx512_bf16_gemm.c where it has AVX-512 BF16), or oneDNN as when
    ours cannot be built."""
    if request.param == "onednn":
        monkeypatch.setattr(packed_linear, "gemm_for", lambda dtype: None)
    elif load_packed_gemm() is None:
        pytest.skip("no C compiler here: linears fall back to oneDNN")
    return str(request.param)


def ours_packs(dtype: torch.dtype, in_features: int, gemm: str) -> bool:
    """Whether one of our GEMMs takes this weight (bf16: AMX takes K in tiles of 32, AVX-512
    BF16 in pairs)."""
    ours = gemm_for(dtype)
    return gemm == "native" and ours is not None and ours.handles(in_features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# AMX takes 64 (two tiles of K), not 16; AVX-512 BF16 both, not 15 (K in pairs)
@pytest.mark.parametrize("in_features", [15, 16, 64])
# 1100: fp32 and AVX-512 BF16 three row blocks; AMX 35 row tiles, rows outer; 20: an AMX tile
# of 16 + 4 rows, an AVX-512 BF16 one of 12 + 8
@pytest.mark.parametrize("rows", [1, 5, 20, 64, 1100])
def test_packed_linear_and_its_post_ops_match_torch(
    dtype: torch.dtype, in_features: int, rows: int, gemm: str
) -> None:
    gen = torch.Generator().manual_seed(rows)
    # 40 outputs: one full panel of 32 columns and a partial one
    weight = torch.randn(40, in_features, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    other = torch.randn(rows, 40, generator=gen).to(dtype)
    packed = PackedLinear(weight, bias)
    native = ours_packs(dtype, in_features, gemm)
    panels = (2, in_features, 32)
    assert (packed.packed_weight.shape == panels) == native, "ours packs 32-column panels"
    plain = F.linear(x.double(), weight.double(), bias.double())
    tol = TOLERANCE[dtype]
    cases = {
        "none": (packed(x), plain),
        "swish": (packed(x, activation="swish"), F.silu(plain)),
        "add": (packed.forward_binary(x, other, "add"), plain + other.double()),
        "mul": (packed.forward_binary(x, other, "mul"), plain * other.double()),
    }
    for name, (got, expected) in cases.items():
        assert got.dtype == dtype, name
        torch.testing.assert_close(got.double(), expected, atol=tol * 4, rtol=tol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("inter", [40, 48])  # 48: groups of 16, so ours runs gate and up as one
# 70: fp32 9 row tiles, so the next-panel prefetch runs; 300: AMX 10 row tiles, rows outer
@pytest.mark.parametrize("rows", [7, 70, 300])
def test_packed_mlp_equals_swiglu_plus_residual(
    dtype: torch.dtype, bias: bool, inter: int, rows: int, gemm: str
) -> None:
    torch.manual_seed(inter)
    hidden = 64  # two AMX tiles of K
    gate_up, down = nn.Linear(hidden, 2 * inter, bias=bias), nn.Linear(inter, hidden, bias=bias)
    x, residual = torch.randn(rows, hidden), torch.randn(rows, hidden)
    gate, up = gate_up(x).split(inter, dim=-1)
    expected = residual + down(F.silu(gate) * up)
    gate_up, down = gate_up.to(dtype), down.to(dtype)
    mlp = PackedMLP(gate_up.weight, gate_up.bias, down)
    one_gemm = ours_packs(dtype, hidden, gemm) and inter % 16 == 0
    assert (mlp.gate_up is not None) == one_gemm and (mlp.gate is None) == one_gemm
    got = mlp(x.to(dtype), residual.to(dtype))
    # bf16: inputs and weights rounded, the hidden rounded once more; sums of 64 terms
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.double(), expected.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "in_features"), [(torch.float32, 8), (torch.bfloat16, 32)])
def test_strided_rows_and_silu_far_out_on_both_sides(dtype: torch.dtype, in_features: int) -> None:
    """x as a column slice (rows strided), and SiLU where exp(-v) overflows or vanishes."""
    if not ours_packs(dtype, in_features, "native"):
        pytest.skip(f"no native {dtype} GEMM here: linears fall back to oneDNN")
    weight = torch.zeros(8, in_features)
    weight[:, :8] = torch.diag(torch.tensor([-200.0, -90.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 200.0]))
    wide = torch.ones(3, in_features + 4).to(dtype)
    x = wide[:, 2 : 2 + in_features]  # rows in_features + 4 apart
    got = PackedLinear(weight.to(dtype), None)(x, activation="swish")
    expected = F.silu(x.double() @ weight.to(dtype).double().T)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_our_gemms_give_a_row_the_same_bits_in_any_batch(dtype: torch.dtype) -> None:
    # Each output is one dot product in a fixed order, whatever the rows around it: what
    # makes greedy output independent of the batch.
    if not ours_packs(dtype, 64, "native"):
        pytest.skip(f"no native {dtype} GEMM here: nothing of ours to check")
    gen = torch.Generator().manual_seed(7)
    packed = PackedLinear(torch.randn(72, 64, generator=gen).to(dtype), None)
    x = torch.randn(600, 64, generator=gen).to(dtype)  # two row blocks of up to 512
    together = packed(x)
    for rows in (slice(0, 1), slice(0, 5), slice(3, 16), slice(0, 64), slice(550, 551)):
        assert torch.equal(packed(x[rows]), together[rows]), f"rows {rows}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_too_big_for_the_caches_stream_out_the_same_bits(dtype: torch.dtype) -> None:
    # Outputs of 2 MiB or more go out with non-temporal stores (stream_store.h), smaller ones
    # through the caches: the same sums either way. 1,040 columns: 32 whole panels and one of
    # 16 (a partial line, never streamed); bf16 rows of 2,080 bytes, so every other row is
    # not line-aligned and takes plain stores. SwiGLU: a panel's 16 outputs are a whole line
    # in fp32 (streamed), half of one in bf16 (never streamed).
    if not ours_packs(dtype, 64, "native"):
        pytest.skip(f"no native {dtype} GEMM here: nothing of ours to check")
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(1040, 64, generator=gen).to(dtype)
    gate, up = torch.randn(2, 1024, 64, generator=gen).to(dtype)
    packed, swiglu = PackedLinear(weight, None), PackedLinear(swiglu_rows(gate, up), None)
    x = torch.randn(1100, 64, generator=gen).to(dtype)
    other = torch.randn(1100, 1040, generator=gen).to(dtype)
    runs = {  # 1,100 rows of each: fp32 4.6, 4.6 and 4.5 MB, bf16 2.3, 2.3 and 2.25 MB
        "none": lambda rows: packed(x[rows]),
        "add": lambda rows: packed.forward_binary(x[rows], other[rows], "add"),
        "swiglu": lambda rows: swiglu(x[rows], activation="swiglu"),
    }
    for name, run in runs.items():
        streamed = run(slice(None))
        for rows in (slice(0, 64), slice(501, 530), slice(1090, 1100)):
            assert torch.equal(run(rows), streamed[rows]), f"{name}, rows {rows}"
    plain = x.double() @ torch.cat((weight, gate, up)).double().T
    expected = {
        "none": plain[:, :1040],
        "swiglu": F.silu(plain[:, 1040:2064]) * plain[:, 2064:],
    }
    tol = TOLERANCE[dtype]
    for name, want in expected.items():  # errors scale with the outputs (SwiGLU's reach 1e3)
        got, scale = runs[name](slice(None)).double(), float(want.abs().max())
        torch.testing.assert_close(got, want, atol=tol * scale, rtol=tol * 2, msg=name)


def test_project_add_fuses_for_packed_and_adds_for_plain() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(8, 8)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    expected = residual + linear(x)
    torch.testing.assert_close(project_add(linear, x, residual), expected)
    packed = PackedLinear(linear.weight, linear.bias)
    torch.testing.assert_close(project_add(packed, x, residual), expected, atol=1e-6, rtol=1e-5)


TINY = ModelConfig(
    model_id="tiny", architecture="llama", num_layers=2, hidden_size=32, num_heads=4,
    num_kv_heads=2, head_dim=8, intermediate_size=48, vocab_size=50, rope_theta=10000.0,
    rms_norm_eps=1e-5, max_context_tokens=64, tie_word_embeddings=True,
)  # fmt: skip


def tiny_model(seed: int) -> LlamaModel:
    """A random 2-layer model in the loader's parameter layout (see engine/model/llama.py)."""
    gen = torch.Generator().manual_seed(seed)
    c = TINY
    shapes = {"embed_tokens.weight": (c.vocab_size, c.hidden_size), "norm.weight": (32,)}
    for i in range(c.num_layers):
        layer = f"layers.{i}"
        shapes |= {
            f"{layer}.input_norm.weight": (32,),
            f"{layer}.post_attn_norm.weight": (32,),
            f"{layer}.attn.qkv_proj.weight": ((c.num_heads + 2 * c.num_kv_heads) * 8, 32),
            f"{layer}.attn.o_proj.weight": (32, c.num_heads * 8),
            f"{layer}.mlp.gate_up_proj.weight": (2 * c.intermediate_size, 32),
            f"{layer}.mlp.down_proj.weight": (32, c.intermediate_size),
        }
    weights = {name: torch.randn(shape, generator=gen) * 0.3 for name, shape in shapes.items()}
    return LlamaModel.from_state_dict(c, weights)


def prefill_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    pool = allocate_kv_cache(TINY, num_blocks=8, block_size=4)
    chunk = ScheduledChunk("s", tuple(ids), 0, tuple(range(8)), sample=True)
    layout = layout_chunks([chunk], 4)
    attn = get_backend("cpu-grouped").build_metadata(layout, 4, TINY.num_layers, pool.device)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(token_positions(layout)), attn, pool)
        return model.compute_logits(hidden)


def test_packing_a_model_keeps_its_logits_and_is_idempotent() -> None:
    model, ids = tiny_model(seed=3), [5, 9, 2, 31, 7, 7, 40]
    before = prefill_logits(model, ids)
    embedding = model.embed_tokens.weight.clone()
    model.pack_linears()
    layers = list(model.modules())
    assert isinstance(model.lm_head, PackedLinear), "a tied head gets a packed copy"
    assert not any(type(m) is nn.Linear for m in layers), "every linear is packed"
    torch.testing.assert_close(prefill_logits(model, ids), before, atol=1e-5, rtol=1e-5)
    model.pack_linears()  # again: nothing changes
    assert list(model.modules()) == layers
    assert torch.equal(model.embed_tokens.weight, embedding), "the lookup table is untouched"
    ours = [m.packed_weight for m in layers if isinstance(m, PackedLinear) and m.gemm]
    if ours:  # our GEMMs' weights were gathered into one buffer (on huge pages)
        assert len({w.untyped_storage().data_ptr() for w in ours}) == 1


def test_tensors_gathered_onto_huge_pages_keep_their_values_side_by_side() -> None:
    tensors = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.arange(9).int()]
    copies = on_huge_pages(tensors)
    for tensor, copy in zip(tensors, copies, strict=True):
        assert torch.equal(copy, tensor) and copy.shape == tensor.shape
        assert copy.is_contiguous() and copy.data_ptr() % 64 == 0
        assert copy.data_ptr() != tensor.data_ptr()
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1, "one buffer"
    release_free_heap()  # True or False (not glibc): either way the copies stay intact
    assert all(torch.equal(c, t) for c, t in zip(copies, tensors, strict=True))


def test_kv_pool_is_zeroed_with_the_contract_shape() -> None:
    pool = allocate_kv_cache(TINY, num_blocks=40, block_size=16)
    assert tuple(pool.shape) == kv_cache_shape(TINY, 40, 16)
    assert pool.is_contiguous() and not pool.any()


def test_huge_page_advice_never_breaks_the_tensor() -> None:
    small = torch.empty(10)  # smaller than one huge page: nothing to advise
    assert advise_huge_pages(small) is False
    big = torch.empty(3 * 2**20)  # 12 MiB: whole huge pages inside
    advise_huge_pages(big)  # True on Linux with THP; either way the tensor still works
    big.fill_(2.0)
    assert float(big.sum()) == 6 * 2**20


def test_kept_heap_reuses_freed_activation_pages() -> None:
    if not keep_freed_memory():
        pytest.skip("this C library has no glibc mallopt; nothing to check")

    def touch_and_free() -> None:
        torch.empty(13 * 2**20 // 4).fill_(1.0)  # a 2,048-token chunk's largest activation

    for _ in range(3):  # the first ones may grow the heap
        touch_and_free()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        touch_and_free()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # Through mmap each round faults all of its 3,328 pages in again (23,296 for 10 here).
    assert faults < 3_328, f"{faults} page faults for 10 reused 13 MiB buffers"


def test_without_amx_or_avx512_bf16_linears_stay_on_onednn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class LibraryWithoutBf16:  # built on a CPU with neither: cannot exist on this one
        @staticmethod
        def pdserve_amx_init() -> int:
            return -1

        @staticmethod
        def pdserve_avx512_bf16_init() -> int:
            return -1

    monkeypatch.setattr(packed_gemm, "load_library", lambda *args: LibraryWithoutBf16())
    bf16_loaders = (packed_gemm.load_amx_gemm, packed_gemm.load_avx512_bf16_gemm)
    for loader in bf16_loaders:
        loader.cache_clear()
    try:
        assert gemm_for(torch.bfloat16) is None
        weight = torch.randn(40, 64).to(torch.bfloat16)
        packed = PackedLinear(weight, None)
        assert packed.packed_weight.shape != (2, 64, 32), "oneDNN's layout, not our panels"
        x = torch.randn(3, 64).to(torch.bfloat16)
        expected = F.linear(x.double(), weight.double())
        torch.testing.assert_close(packed(x).double(), expected, atol=8e-2, rtol=2e-2)
    finally:
        for loader in bf16_loaders:
            loader.cache_clear()  # the next caller loads the real library
