"""RMSNorm and RoPE in one pass each (``fused_ops.c``): built at first use, called via ctypes.

The model calls :func:`fused_ops` and falls back to its torch code when it returns None (no
C compiler, a failed build: the reason is logged once) or when a tensor is not one the C
side takes (another dtype, rows not dense). See the C file for why and for the rounding,
which matches the torch code.

CUDA tensors go to one Triton kernel each instead (``triton_ops.py``, imported at the first
CUDA tensor; without Triton the torch code runs, the reason logged once). They ride on the
same :class:`FusedOps` object, so they too need :func:`fused_ops` to have built: a host
without a C compiler could not run Triton either (it compiles its launcher with one).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from types import ModuleType
from typing import Any

import torch

from pdserve.engine.native_build import BASE_CFLAGS, CSRC, load_library

SOURCE = CSRC / "fused_ops.c"
# No FMA contraction: each product and sum rounds where torch's separate kernels round.
CFLAGS = (*BASE_CFLAGS, "-ffp-contract=off")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
logger = logging.getLogger(__name__)
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_RMS_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    _PTR, _I64, _I64, _I64,  # x, x_stride, rows, cols
    _PTR, ctypes.c_float, _PTR, ctypes.c_int, ctypes.c_int,  # weight, eps, out, dtype, threads
]  # fmt: skip
_ROPE_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    _PTR, _I64, _I64, _I64, _I64,  # x, x_stride, tokens, heads, head_dim
    _PTR, _PTR, _PTR, ctypes.c_int, ctypes.c_int,  # cos, sin, out, dtype, threads
]  # fmt: skip


class FusedOps:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._rms_norm = library.pdserve_rms_norm
        self._rms_norm.argtypes = _RMS_ARGTYPES
        self._rms_norm.restype = None
        self._rope = library.pdserve_rope
        self._rope.argtypes = _ROPE_ARGTYPES
        self._rope.restype = None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """``x: [T, hidden]`` normalised and scaled by ``weight``; None if not taken here."""
        if not _rms_norm_layout(x, weight):
            return None
        if x.is_cuda:
            return _cuda_rms_norm(x, weight, eps)
        if not _takes(x, weight):
            return None
        rows, cols = x.shape
        out = torch.empty((rows, cols), dtype=x.dtype)
        self.rms_norm_into(x.data_ptr(), x.stride(0), rows, weight, eps, out.data_ptr())
        return out

    def rms_norm_into(
        self, x: int, x_stride: int, rows: int, weight: torch.Tensor, eps: float, out: int
    ) -> None:
        """:meth:`rms_norm` on addresses (rows of ``weight``'s size and dtype, out dense),
        unchecked: for a caller that checked its buffers once."""
        self._rms_norm(
            x, x_stride, rows, weight.shape[0], weight.data_ptr(), eps, out,
            _DTYPE_CODES[weight.dtype], torch.get_num_threads(),
        )  # fmt: skip

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """``x: [T, heads, head_dim]`` rotated by ``cos``/``sin: [T, 1, head_dim / 2]`` into a
        new dense tensor; None if not taken here."""
        if not _rope_layout(x, cos, sin):
            return None
        if x.is_cuda:
            return _cuda_rope(x, cos, sin)
        if not (_takes(x, cos, sin) and x.stride(1) == x.shape[2]):
            return None
        tokens, heads, head_dim = x.shape
        out = torch.empty((tokens, heads, head_dim), dtype=x.dtype)
        self.rope_into(x.data_ptr(), x.stride(0), tokens, heads, cos, sin, out.data_ptr())
        return out

    def rope_into(
        self, x: int, x_stride: int, tokens: int, heads: int, cos: torch.Tensor,
        sin: torch.Tensor, out: int,
    ) -> None:  # fmt: skip
        """:meth:`rope` on addresses (head_dim from ``cos``, the dtype ``cos``'s), unchecked:
        for a caller that checked its buffers once."""
        self._rope(
            x, x_stride, tokens, heads, 2 * cos.shape[-1], cos.data_ptr(), sin.data_ptr(), out,
            _DTYPE_CODES[cos.dtype], torch.get_num_threads(),
        )  # fmt: skip


def _takes(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """CPU tensors of one dtype the C side knows."""
    return (
        x.device.type == "cpu"
        and x.dtype in _DTYPE_CODES
        and all(t.device.type == "cpu" and t.dtype == x.dtype for t in others)
    )


@functools.cache
def fused_ops() -> FusedOps | None:
    """The fused ops, building them on first use; None (reason logged) when they cannot be."""
    library = load_library(SOURCE, CFLAGS, "fused RMSNorm/RoPE")
    return None if library is None else FusedOps(library)


def _rms_norm_layout(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Dense rows ``[T, hidden]`` and a dense ``[hidden]`` weight (both kernels' layout)."""
    return (
        x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous() and weight.shape == x.shape[1:]
    )


def _rope_layout(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """``x: [T, heads, head_dim]`` with dense head rows, dense ``cos``/``sin: [T, 1,
    head_dim / 2]`` (both kernels' layout; the C one also wants the heads of a token dense)."""
    return (
        x.dim() == 3
        and x.stride(2) == 1
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2] // 2)
    )


@functools.cache
def cuda_fused_ops() -> ModuleType | None:
    """The Triton kernels (``triton_ops.py``), imported at first use; None (reason logged
    once) without Triton."""
    try:
        from pdserve.engine.model import triton_ops
    except ImportError as exc:
        logger.warning("no Triton (%s): RMSNorm and RoPE on CUDA keep their torch code", exc)
        return None
    return triton_ops


def _cuda_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    ops = cuda_fused_ops()
    if ops is None or not _cuda_takes(x, weight):
        return None
    out: torch.Tensor = ops.rms_norm(x, weight, eps)
    return out


def _cuda_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    ops = cuda_fused_ops()
    if ops is None or not _cuda_takes(x, cos, sin):
        return None
    out: torch.Tensor = ops.rope(x, cos, sin)
    return out


def _cuda_takes(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Tensors of one dtype the Triton kernels take, on x's CUDA device."""
    return x.dtype in _CUDA_DTYPES and all(
        t.device == x.device and t.dtype == x.dtype for t in others
    )
