"""The native paged prefill kernel (``paged_prefill.c``): fp32 or bf16 queries over a pool of
their dtype or of int8 rows; built at first use, called via ctypes.

Without a compiler (or on a failed build) the loader returns None with the reason logged,
and the CPU backend keeps torch's flash kernel for prefill chunks (``cpu_prefill.py``), as it
does for bf16 chunks on CPUs with AMX (:meth:`PagedPrefillKernel.preferred_for`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch

from pdserve.engine.attention.kv_format import BFLOAT16, FLOAT32, kv_format_of
from pdserve.engine.native_build import BASE_CFLAGS, CSRC, cpu_flags, load_library

SOURCE = CSRC / "paged_prefill.c"
# FMA contraction, as in any GEMM; no trapping math lets the exp polynomial vectorize.
CFLAGS = (*BASE_CFLAGS, "-ffp-contract=fast", "-fno-trapping-math")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    _PTR, _I64, _I64, _I64, _PTR,  # q, q_row_stride, n, start, ancestors (NULL: causal)
    _PTR, _PTR, _PTR, _I64,  # pool, table, out, out_row_stride
    _I64, _I64, _I64, _I64, _I64, _I64,  # heads, kv_heads, head_dim, layers, block_size, layer
    ctypes.c_int, ctypes.c_int, ctypes.c_int,  # dtype, kv_format, num_threads
]  # fmt: skip
_DTYPE_CODES = {torch.float32: FLOAT32.kernel_code, torch.bfloat16: BFLOAT16.kernel_code}


# Rows of a token tree the kernel takes (a row's ancestors are bits of one uint64).
MAX_TREE_ROWS = 64


class PagedPrefillKernel:
    """Causal attention of one sequence's prefill chunk over the paged pool, or a token
    tree's attention by ancestry (see the C file)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.pdserve_paged_prefill
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int

    @staticmethod
    def handles(dtype: torch.dtype, kv_cache: torch.Tensor) -> bool:
        """fp32 or bf16 queries (``dtype``) over an int8 pool or one of their dtype (a bf16
        one where the CPU has AVX-512 BF16: the kernel's bf16 path is vdpbf16ps), with a
        head_dim the kernel's 8-wide output tiles divide."""
        if dtype not in _DTYPE_CODES or kv_cache.dtype not in (dtype, torch.int8):
            return False
        bf16_pool = kv_cache.dtype == torch.bfloat16
        head_dim = kv_format_of(kv_cache).head_dim(kv_cache)
        return (not bf16_pool or "avx512_bf16" in cpu_flags()) and head_dim % 8 == 0

    @classmethod
    def preferred_for(cls, dtype: torch.dtype, kv_cache: torch.Tensor) -> bool:
        """Whether to run this kernel rather than torch's flash kernel: for what it handles,
        except a bf16 pool on a CPU with AMX, where torch's kernel runs bf16 on AMX tiles (at
        512 tokens 0.91 ms against this kernel's fp32 arithmetic in 1.48 ms, Sapphire
        Rapids). An int8 pool takes this kernel: torch's would first dequantize a gather."""
        amx_wins = kv_cache.dtype == torch.bfloat16 and "amx_bf16" in cpu_flags()
        return cls.handles(dtype, kv_cache) and not amx_wins

    def bind_tree(
        self,
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, row], contiguous
        dtype: torch.dtype,  # of the step's q and out
        num_heads: int,
        first_row: int,  # the tree chunk's first row in the step's q and out
        start: int,
        table: torch.Tensor,  # [W] int32, block ids validated by the caller
        ancestors: torch.Tensor,  # [n] int64
    ) -> Callable[[int, int, int, int, int], None]:
        """A tree chunk's attention on addresses: ``(layer, q, q_row_stride, out,
        out_row_stride)`` of the whole step, for the native step (``native_step.py``)."""
        n = ancestors.shape[0]
        _, num_layers, _, block_size, kv_heads, _ = kv_cache.shape
        kv_format = kv_format_of(kv_cache)
        head_dim = kv_format.head_dim(kv_cache)
        assert kv_cache.is_contiguous() and kv_cache.dtype in (dtype, torch.int8), "pool"
        assert table.dtype == torch.int32 and table.is_contiguous(), "table not dense int32"
        assert table.shape[0] * block_size >= start + n, "table shorter than the chunk's end"
        assert ancestors.dtype == torch.int64 and ancestors.is_contiguous(), "not dense int64"
        assert n <= MAX_TREE_ROWS, f"{n} rows"
        element = dtype.itemsize  # of q and out, whose addresses are offset here
        codes = (_DTYPE_CODES[dtype], kv_format.kernel_code)
        pool, table_at, tree_at = kv_cache.data_ptr(), table.data_ptr(), ancestors.data_ptr()
        threads = torch.get_num_threads()

        def attend(layer: int, q: int, q_stride: int, out: int, out_stride: int) -> None:
            status = self._fn(
                q + first_row * q_stride * element, q_stride, n, start, tree_at, pool, table_at,
                out + first_row * out_stride * element, out_stride, num_heads, kv_heads,
                head_dim, num_layers, block_size, layer, *codes, threads,
            )  # fmt: skip
            if status != 0:
                raise MemoryError(f"paged prefill kernel failed on a tree (status {status})")

        return attend

    def __call__(
        self,
        q: torch.Tensor,  # [n, H, D] fp32 or bf16; rows may be strided (a view into the qkv)
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, row], contiguous
        table: torch.Tensor,  # [W] int32: the sequence's blocks, covering start + n positions
        start: int,  # position of the chunk's first token
        layer_idx: int,
        out: torch.Tensor,  # [n, H * D], rows written
        ancestors: torch.Tensor | None = None,  # [n] int64: bit c of row r = r sees row c
    ) -> None:
        n, num_heads, head_dim = q.shape
        num_layers, block_size, kv_heads = kv_cache.shape[1], kv_cache.shape[3], kv_cache.shape[4]
        kv_format = kv_format_of(kv_cache)
        # The C side trusts every pointer and stride it gets: check them here.
        assert self.handles(q.dtype, kv_cache), f"q {q.dtype}, pool {kv_cache.dtype}"
        assert q.dtype == out.dtype and head_dim == kv_format.head_dim(kv_cache), "q, out"
        assert q.stride(2) == 1 and q.stride(1) == head_dim, f"q strides {q.stride()}"
        assert out.shape == (n, num_heads * head_dim) and out.stride(1) == 1, "out not [n, H*D]"
        assert kv_cache.is_contiguous() and num_heads % kv_heads == 0, "pool not dense / GQA"
        assert table.dtype == torch.int32 and table.is_contiguous(), "table not dense int32"
        assert table.shape[0] * block_size >= start + n, "table shorter than the chunk's end"
        assert q.device.type == kv_cache.device.type == "cpu", "the kernel runs on CPU tensors"
        if ancestors is not None:
            assert ancestors.dtype == torch.int64 and ancestors.is_contiguous(), "not dense int64"
            assert ancestors.shape == (n,) and n <= MAX_TREE_ROWS, f"{n} rows, {ancestors.shape}"
        tree = None if ancestors is None else ancestors.data_ptr()
        status = self._fn(
            q.data_ptr(), q.stride(0), n, start, tree, kv_cache.data_ptr(), table.data_ptr(),
            out.data_ptr(), out.stride(0), num_heads, kv_heads, head_dim, num_layers,
            block_size, layer_idx, _DTYPE_CODES[q.dtype], kv_format.kernel_code,
            torch.get_num_threads(),
        )  # fmt: skip
        assert status != -2, "a bf16 pool in a build without AVX-512 BF16: see handles()"
        if status != 0:
            raise MemoryError(f"paged prefill kernel could not allocate scratch (status {status})")


@functools.cache
def load_paged_prefill() -> PagedPrefillKernel | None:
    """The kernel, building it on first use; None (reason logged) when it cannot be built."""
    library = load_library(SOURCE, CFLAGS, "native paged prefill kernel")
    return None if library is None else PagedPrefillKernel(library)
