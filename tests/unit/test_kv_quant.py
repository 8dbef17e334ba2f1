"""Unit tests of int8 KV quantization for transfer: scales, error bound, record bytes."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kv_transfer import quant
from pdserve.kv_transfer.layout import KVPoolLayout

LAYOUT = KVPoolLayout(32, 4, 4, 2, 8, torch.float32)  # blocks, layers, bs, kv heads, head_dim
# int8 record of LAYOUT, from quant.py's table: bf16 k_scales [L, H, D], bf16 v_scales
# [L, bs, H], int8 values [L, 2, bs, H, D] with L=4, bs=4, H=2, D=8.
ELEMS = 4 * 2 * 4 * 2 * 8
INT8_RECORD_BYTES = 2 * 4 * 2 * 8 + 2 * 4 * 4 * 2 + ELEMS
# A bf16 scale is absmax / 127 rounded *up* to bf16's 8 significant bits (quant.py).
BF16_ROUND_UP = 1 + 2**-7


def _reference_steps(blocks: np.ndarray) -> np.ndarray:
    """absmax / 127 of each element's group, per quant.py's doc: K per (layer, head, channel)
    over the block's tokens, V per (layer, token, head) over the channels. Same shape."""
    # blocks: [n, L, 2, bs, H, D]
    magnitude = np.abs(blocks)
    steps = np.empty_like(blocks)
    steps[:, :, 0] = magnitude[:, :, 0].max(axis=2, keepdims=True) / np.float32(127)
    steps[:, :, 1] = magnitude[:, :, 1].max(axis=4, keepdims=True) / np.float32(127)
    return steps


def test_int8_scales_follow_k_channels_and_v_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randn(6, *LAYOUT.block_shape, generator=gen) * 3.0
    # K outlier channel (what per-slice scales handled badly) and an outlier V token.
    blocks[:, :, 0, :, 1, 5] *= 60.0
    blocks[:, :, 1, 2, 0, :] *= 60.0
    blocks[2, 1, 0, :, 1, 3] = 0.0  # an all-zero K group (one channel) must stay zero
    blocks[4, 0, 1, 3, 0, :] = 0.0  # an all-zero V group (one token) must stay zero
    q = quant.quantize_blocks(blocks)
    steps = _reference_steps(blocks.numpy())  # computed independently with numpy
    k_scales, v_scales = q.k_scales.float().numpy(), q.v_scales.float().numpy()
    assert q.k_scales.dtype == q.v_scales.dtype == torch.bfloat16
    assert k_scales.shape == (6, 4, 2, 8) and v_scales.shape == (6, 4, 4, 2)
    want_k, want_v = steps[:, :, 0, 0], steps[:, :, 1, ..., 0]
    for got, want in ((k_scales, want_k), (v_scales, want_v)):
        assert (got >= want).all() and (got <= want * BF16_ROUND_UP).all()
        assert (got > want).any()  # rounding up was exercised
    restored = quant.dequantize_blocks(q, torch.float32)
    error = (restored - blocks).abs().numpy()
    assert (error <= steps * BF16_ROUND_UP / 2 + 1e-6).all()
    assert torch.count_nonzero(restored[2, 1, 0, :, 1, 3]) == 0
    assert torch.count_nonzero(restored[4, 0, 1, 3, 0]) == 0
    assert q.values.dtype == torch.int8 and int(q.values.abs().max()) <= 127


def _bf16_bytes(scales: np.ndarray) -> bytes:
    """bf16 of float32 values that bf16 holds exactly: the high half of their bits."""
    return (scales.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()


def test_int8_records_follow_the_documented_byte_layout() -> None:
    # Blocks that int8 represents exactly: int8 values times power-of-two scales, each
    # K group (over tokens) and V group (over channels) reaching |127| once.
    rng = np.random.default_rng(1)
    n, (layers, _, bs, heads, dim) = 2, LAYOUT.block_shape
    values = rng.integers(-126, 127, size=(n, layers, 2, bs, heads, dim)).astype(np.int8)
    values[:, :, 0, 0] = 127
    values[:, :, 1, ..., 0] = -127
    k_scales = 2.0 ** rng.integers(-8, 4, size=(n, layers, heads, dim))
    v_scales = 2.0 ** rng.integers(-8, 4, size=(n, layers, bs, heads))
    blocks = values.astype(np.float32)
    blocks[:, :, 0] *= k_scales[:, :, None]
    blocks[:, :, 1] *= v_scales[..., None]
    expected = b"".join(
        _bf16_bytes(k_scales[i]) + _bf16_bytes(v_scales[i]) + values[i].tobytes() for i in range(n)
    )
    records = quant.encode_records(torch.from_numpy(blocks), LAYOUT)
    assert records.shape == (n, INT8_RECORD_BYTES)
    assert records.numpy().tobytes() == expected
    pool = torch.zeros(LAYOUT.pool_shape)
    wire = torch.frombuffer(bytearray(expected), dtype=torch.uint8).reshape(n, -1)
    quant.decode_records_into(wire, pool, [3, 7], LAYOUT)
    assert torch.equal(pool[[3, 7]], torch.from_numpy(blocks))


def test_int8_records_round_trip_into_a_bf16_pool() -> None:
    layout = KVPoolLayout(8, 4, 4, 2, 8, torch.bfloat16)
    src = torch.randn(layout.pool_shape).to(torch.bfloat16)
    records = quant.encode_records(src[[1, 5]], layout)
    assert records.shape == (2, quant.record_bytes(layout))
    pool = torch.zeros(layout.pool_shape, dtype=torch.bfloat16)
    quant.decode_records_into(records, pool, [6, 0], layout)
    want = src[[1, 5]].float()
    steps = torch.from_numpy(_reference_steps(want.numpy()))
    # Half an int8 step, plus bf16 rounding of the result (relative 2^-8).
    bound = steps * BF16_ROUND_UP / 2 + want.abs() * 2**-8 + 1e-6
    assert bool(((pool[[6, 0]].float() - want).abs() <= bound).all())
    assert torch.count_nonzero(pool[[2, 3, 4, 7]]) == 0


def test_int8_bytes_saved() -> None:
    assert quant.bytes_saved(LAYOUT, 10) == 10 * (ELEMS * 4 - INT8_RECORD_BYTES)
