"""The native paged decode kernel (``paged_decode.c``), and its store of a step's K/V into
the pool: built at first use, called via ctypes.

``engine/native_build.py`` compiles it once per machine into the pdserve cache directory.
Without a compiler (or on a failed build) the loader returns None with the reason logged,
and the CPU backend keeps its pure-torch decode path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from engine.native_build import BASE_CFLAGS, load_library

SOURCE = Path(__file__).with_name("paged_decode.c")
# FMA contraction and the freedom to reorder around signed zeros let the dot products and
# the softmax vectorize (measured 1.2x); unlike -ffast-math this keeps inf/NaN semantics and
# links no startup code that would flush denormals for the whole process.
CFLAGS = (*BASE_CFLAGS, "-ffp-contract=fast", "-fno-signed-zeros", "-fno-trapping-math")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    _PTR, _I64, _PTR,  # q, q_row_stride, q_rows
    _PTR, _PTR, _I64, _PTR, _I64,  # pool, tables, table_width, lens, num_seqs
    _PTR, _I64,  # out, out_row_stride
    _I64, _I64, _I64, _I64, _I64, _I64,  # heads, kv_heads, head_dim, layers, block_size, layer
    ctypes.c_float, ctypes.c_int, ctypes.c_int,  # scale, dtype, num_threads
]  # fmt: skip
_STORE_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    _PTR, _I64, _PTR, _I64, _I64,  # k, k_row_stride, v, v_row_stride, tokens
    _PTR, _I64, _PTR, _I64, _I64,  # rows, layer_add, pool, pool_rows, row_elems
    ctypes.c_int, ctypes.c_int,  # dtype, num_threads
]  # fmt: skip


class PagedDecodeKernel:
    """Decode attention over the paged pool, one query token per sequence (see the C file)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.pdserve_paged_decode
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int
        self._store = library.pdserve_store_kv
        self._store.argtypes = _STORE_ARGTYPES
        self._store.restype = ctypes.c_int

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]; rows may be strided (a view into the fused qkv)
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, D], contiguous
        tables: torch.Tensor,  # [B, W] int32, validated by the caller
        lens: torch.Tensor,  # [B] int32
        q_rows: torch.Tensor | None,  # [B] int32 rows of q (and out); None: rows 0..B-1
        layer_idx: int,
        out: torch.Tensor,  # [T, H * D], rows written for the B sequences
    ) -> None:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_layers, block_size, kv_heads = kv_cache.shape[1], kv_cache.shape[3], kv_cache.shape[4]
        # The C side trusts every pointer and stride it gets: check them here.
        assert q.dtype in _DTYPE_CODES, f"the kernel takes fp32 or bf16, got {q.dtype}"
        assert q.dtype == kv_cache.dtype == out.dtype, f"{q.dtype}, {kv_cache.dtype}, {out.dtype}"
        assert q.stride(2) == 1 and q.stride(1) == head_dim, f"q strides {q.stride()}"
        assert out.stride(1) == 1 and kv_cache.is_contiguous(), "out rows / pool not dense"
        for index in (tables, lens) if q_rows is None else (tables, lens, q_rows):
            assert index.dtype == torch.int32 and index.is_contiguous(), "index not dense int32"
        assert q.device.type == kv_cache.device.type == "cpu", "the kernel runs on CPU tensors"
        status = self._fn(
            q.data_ptr(), q.stride(0), 0 if q_rows is None else q_rows.data_ptr(),
            kv_cache.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
            lens.shape[0], out.data_ptr(), out.stride(0),
            num_heads, kv_heads, head_dim, num_layers, block_size, layer_idx,
            head_dim**-0.5, _DTYPE_CODES[q.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError(f"paged decode kernel could not allocate scratch (status {status})")

    def store_kv(
        self,
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, D], contiguous
        layer_idx: int,
        rows: torch.Tensor,  # [2, T] int64 layer-0 rows of K and V (``pool_write_rows``)
        k: torch.Tensor,  # [T, KVH, D]; rows may be strided (views into the fused qkv)
        v: torch.Tensor,
    ) -> None:
        """What ``engine.attention.base.write_kv`` does, with stores that skip reading the
        pool's cold lines first (see ``pdserve_store_kv``)."""
        block_size, kv_heads, head_dim = kv_cache.shape[3:]
        row_elems = kv_heads * head_dim
        # The C side trusts pointers and strides (it checks the rows): check them here.
        assert k.dtype == v.dtype == kv_cache.dtype in _DTYPE_CODES, f"{k.dtype}, {v.dtype}"
        assert k.shape == v.shape == (rows.shape[1], kv_heads, head_dim), f"k {tuple(k.shape)}"
        for x in (k, v):
            assert x.stride(2) == 1 and x.stride(1) == head_dim, f"strides {x.stride()}"
        assert rows.dtype == torch.int64 and rows.is_contiguous(), "rows not dense int64"
        assert kv_cache.is_contiguous() and kv_cache.device.type == "cpu", "pool not dense"
        status = self._store(
            k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.shape[0], rows.data_ptr(),
            layer_idx * 2 * block_size, kv_cache.data_ptr(), kv_cache.numel() // row_elems,
            row_elems, _DTYPE_CODES[k.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise IndexError(f"a K/V row of layer {layer_idx} lies outside the pool")


@functools.cache
def load_paged_decode() -> PagedDecodeKernel | None:
    """The kernel, building it on first use; None (reason logged) when it cannot be built."""
    library = load_library(SOURCE, CFLAGS, "native paged decode kernel")
    return None if library is None else PagedDecodeKernel(library)
