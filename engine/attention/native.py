"""The native paged decode kernel (``paged_decode.c``), and its store of a step's K/V into
the pool: built at first use, called via ctypes.

``engine/native_build.py`` compiles it once per machine into the pdserve cache directory.
Without a compiler (or on a failed build) the loader returns None with the reason logged,
and the CPU backend keeps its pure-torch decode path.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.attention.kv_format import BFLOAT16, FLOAT32, kv_format_of
from pdserve.engine.native_build import BASE_CFLAGS, CSRC, load_library

SOURCE = CSRC / "paged_decode.c"
# FMA contraction and the freedom to reorder around signed zeros let the dot products and
# the softmax vectorize (measured 1.2x); unlike -ffast-math this keeps inf/NaN semantics and
# links no startup code that would flush denormals for the whole process.
CFLAGS = (*BASE_CFLAGS, "-ffp-contract=fast", "-fno-signed-zeros", "-fno-trapping-math")
_DTYPE_CODES = {torch.float32: FLOAT32.kernel_code, torch.bfloat16: BFLOAT16.kernel_code}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    _PTR, _I64, _PTR,  # q, q_row_stride, q_rows
    _PTR, _PTR, _I64, _PTR, _I64,  # pool, tables, table_width, lens, num_seqs
    _PTR, _I64,  # out, out_row_stride
    _I64, _I64, _I64, _I64, _I64, _I64,  # heads, kv_heads, head_dim, layers, block_size, layer
    ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # scale, dtype, kv_format, threads
]  # fmt: skip
_STORE_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    _PTR, _I64, _PTR, _I64, _I64,  # k, k_row_stride, v, v_row_stride, tokens
    _PTR, _I64, _PTR, _I64, _I64, _I64,  # rows, layer_add, pool, pool_rows, kv_heads, head_dim
    ctypes.c_int, ctypes.c_int, ctypes.c_int,  # dtype, kv_format, num_threads
]  # fmt: skip


class PagedDecodeKernel:
    """Decode attention over the paged pool, one query token per sequence, and the store of a
    step's K/V into the pool (see the C file). Queries, outputs and the step's K/V are fp32
    or bf16; the pool holds their dtype or int8 rows (``kv_format.py``)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._attend = library.pdserve_paged_decode
        self._attend.argtypes = _ARGTYPES
        self._attend.restype = ctypes.c_int
        self._store = library.pdserve_store_kv
        self._store.argtypes = _STORE_ARGTYPES
        self._store.restype = ctypes.c_int

    def bind(
        self,
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, row], contiguous
        dtype: torch.dtype,  # of q, out and the step's K/V
        num_heads: int,
        tables: torch.Tensor | None = None,  # [B, W] int32, block ids validated by the caller
        lens: torch.Tensor | None = None,  # [B] int32
        q_rows: torch.Tensor | None = None,  # [B] int32 rows of q (and out); None: 0..B-1
        write_rows: torch.Tensor | None = None,  # [2, T] int64 (``pool_write_rows``)
    ) -> BoundDecode:
        """One step's pool and indices, checked once, for calls on addresses (the C side
        trusts every pointer it gets; the caller vouches for the q, K/V and out rows)."""
        kv_format = kv_format_of(kv_cache)
        assert dtype in _DTYPE_CODES, f"the kernel's queries are fp32 or bf16, not {dtype}"
        assert kv_cache.dtype in (dtype, torch.int8), f"a {kv_cache.dtype} pool for {dtype}"
        assert kv_cache.is_contiguous() and kv_cache.device.type == "cpu", "pool not dense"
        int32s = [t for t in (tables, lens, q_rows) if t is not None]
        for index in int32s:
            assert index.dtype == torch.int32 and index.is_contiguous(), "index not dense int32"
        if write_rows is not None:
            assert write_rows.dtype == torch.int64 and write_rows.is_contiguous(), "rows"
        _, num_layers, _, block_size, kv_heads, row = kv_cache.shape
        head_dim = kv_format.head_dim(kv_cache)
        pool_rows = kv_cache.numel() // (kv_heads * row)
        return BoundDecode(
            self._attend, self._store, kv_cache.data_ptr(), pool_rows,
            num_heads, kv_heads, head_dim, num_layers, block_size,
            _addr(tables), 0 if tables is None else tables.shape[1], _addr(lens),
            0 if lens is None else lens.shape[0], _addr(q_rows), _addr(write_rows),
            0 if write_rows is None else write_rows.shape[1],
            _DTYPE_CODES[dtype], kv_format.kernel_code, torch.get_num_threads(),
        )  # fmt: skip

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]; rows may be strided (a view into the fused qkv)
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, row], contiguous
        tables: torch.Tensor,  # [B, W] int32, validated by the caller
        lens: torch.Tensor,  # [B] int32
        q_rows: torch.Tensor | None,  # [B] int32 rows of q (and out); None: rows 0..B-1
        layer_idx: int,
        out: torch.Tensor,  # [T, H * D], rows written for the B sequences
    ) -> None:
        head_dim = q.shape[2]
        assert q.dtype == out.dtype, f"q {q.dtype}, out {out.dtype}"
        assert head_dim == kv_format_of(kv_cache).head_dim(kv_cache), f"q {tuple(q.shape)}"
        assert q.stride(2) == 1 and q.stride(1) == head_dim, f"q strides {q.stride()}"
        assert out.stride(1) == 1 and q.device.type == "cpu", "out rows not dense / not CPU"
        bound = self.bind(kv_cache, q.dtype, q.shape[1], tables, lens, q_rows)
        bound.attend(layer_idx, q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0))

    def store_kv(
        self,
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, row], contiguous
        layer_idx: int,
        rows: torch.Tensor,  # [2, T] int64 layer-0 rows of K and V (``pool_write_rows``)
        k: torch.Tensor,  # [T, KVH, D]; rows may be strided (views into the fused qkv)
        v: torch.Tensor,
    ) -> None:
        """What ``pdserve.engine.attention.base.write_kv`` does (an int8 pool's rows quantized
        bit for bit alike), with stores that skip reading the pool's cold lines first (see
        ``pdserve_store_kv``)."""
        kv_heads, head_dim = kv_cache.shape[4], kv_format_of(kv_cache).head_dim(kv_cache)
        assert k.dtype == v.dtype, f"k {k.dtype}, v {v.dtype}"
        assert k.shape == v.shape == (rows.shape[1], kv_heads, head_dim), f"k {tuple(k.shape)}"
        for x in (k, v):
            assert x.stride(2) == 1 and x.stride(1) == head_dim, f"strides {x.stride()}"
        bound = self.bind(kv_cache, k.dtype, 0, write_rows=rows)
        bound.store(layer_idx, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0))


@dataclass(slots=True, frozen=True)
class BoundDecode:
    """:class:`PagedDecodeKernel`'s calls for one step, on addresses (see ``bind``)."""

    _attend: Any
    _store: Any
    pool: int
    pool_rows: int  # rows of kv_heads * head_dim elements
    num_heads: int
    kv_heads: int
    head_dim: int
    num_layers: int
    block_size: int
    tables: int
    table_width: int
    lens: int
    num_seqs: int
    q_rows: int
    write_rows: int
    num_tokens: int
    dtype: int  # of q, out and the step's K/V
    kv_format: int  # of the pool (``KVFormat.kernel_code``)
    threads: int
    # Rows the step attends another way (token trees, by the prefill kernel): called with the
    # same arguments as attend, after the decode rows; and how many rows they cover.
    more_rows: tuple[Callable[[int, int, int, int, int], None], ...] = ()
    num_more_rows: int = 0

    def attend(
        self, layer_idx: int, q: int, q_row_stride: int, out: int, out_row_stride: int
    ) -> None:
        """Attention of layer ``layer_idx``: ``more_rows`` and the decode rows (the rows of q:
        [H, D] dense each)."""
        for attend_more in self.more_rows:
            attend_more(layer_idx, q, q_row_stride, out, out_row_stride)
        if self.num_seqs == 0:
            return
        assert self.tables and self.lens, "bound without block tables"
        status = self._attend(
            q, q_row_stride, self.q_rows, self.pool, self.tables, self.table_width, self.lens,
            self.num_seqs, out, out_row_stride, self.num_heads, self.kv_heads, self.head_dim,
            self.num_layers, self.block_size, layer_idx, self.head_dim**-0.5, self.dtype,
            self.kv_format, self.threads,
        )  # fmt: skip
        if status != 0:
            raise MemoryError(f"paged decode kernel could not allocate scratch (status {status})")

    def store(self, layer_idx: int, k: int, k_row_stride: int, v: int, v_row_stride: int) -> None:
        """The step's K/V rows (each [KVH, D] dense) into layer ``layer_idx`` of the pool."""
        assert self.write_rows, "bound without the step's pool rows"
        status = self._store(
            k, k_row_stride, v, v_row_stride, self.num_tokens, self.write_rows,
            layer_idx * 2 * self.block_size, self.pool, self.pool_rows, self.kv_heads,
            self.head_dim, self.dtype, self.kv_format, self.threads,
        )  # fmt: skip
        if status != 0:
            raise IndexError(f"a K/V row of layer {layer_idx} lies outside the pool")


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


@functools.cache
def load_paged_decode() -> PagedDecodeKernel | None:
    """The kernel, building it on first use; None (reason logged) when it cannot be built."""
    library = load_library(SOURCE, CFLAGS, "native paged decode kernel")
    return None if library is None else PagedDecodeKernel(library)
