"""Linears against a weight packed once, built at first use and called via ctypes: fp32 on
``packed_gemm.c``; bf16 on AMX tiles with ``amx_gemm.c`` or, on CPUs without AMX, on AVX-512
BF16 vectors with ``avx512_bf16_gemm.c`` (the same ops, arguments and bf16 layout).

:class:`pdserve.engine.model.packed_linear.PackedLinear` uses them when they load, and oneDNN
otherwise (no C compiler, or bf16 on a CPU with neither: the reason is logged once). See the
C files for the layouts and the measured speed.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.native_build import BASE_CFLAGS, CSRC, load_library

log = logging.getLogger(__name__)

SOURCE = CSRC / "packed_gemm.c"
AMX_SOURCE = CSRC / "amx_gemm.c"
AVX512_BF16_SOURCE = CSRC / "avx512_bf16_gemm.c"
# FMA contraction: the accumulation is one multiply-add per weight, as in any BLAS; no
# trapping math lets the epilogue's floorf vectorize (no effect on results).
CFLAGS = (*BASE_CFLAGS, "-ffp-contract=fast", "-fno-trapping-math")
PANEL = 32  # output columns per packed panel (the C side's PANEL)
OPS = {"none": 0, "swish": 1, "mul": 2, "add": 3, "swiglu": 4}
SWIGLU_GROUP = PANEL // 2  # gate rows, then as many up rows, in each panel of a SwiGLU weight
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_LINEAR_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    _PTR, _I64, _I64, _I64,  # x, x_stride, rows, k
    _PTR, _I64, _PTR, ctypes.c_int,  # packed, n, bias, op
    _PTR, _I64, _PTR, _I64, ctypes.c_int,  # other, other_stride, y, y_stride, threads
]  # fmt: skip


class PackedGemm:
    """Packs weights of one dtype and runs ``op(x @ W.T + bias, other)`` on them (see the C
    files); every tensor it takes is of that dtype."""

    def __init__(
        self, library: ctypes.CDLL, dtype: torch.dtype, pack: str, linear: str, k_multiple: int
    ) -> None:
        self.dtype = dtype
        self._k_multiple = k_multiple  # in_features it takes are multiples of this
        self._pack = getattr(library, pack)
        self._pack.argtypes = [_PTR, _I64, _I64, _I64, _PTR]
        self._pack.restype = None
        self._linear = getattr(library, linear)
        self._linear.argtypes = _LINEAR_ARGTYPES
        self._linear.restype = None

    def handles(self, in_features: int) -> bool:
        """Whether it takes weights with this many inputs (bf16: pairs of K; AMX: whole tiles
        of 32)."""
        return in_features % self._k_multiple == 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight: [out, in]`` -> its panels, ``[ceil(out / 32), in, 32]`` elements (in bf16,
        ordered as pairs of inputs: see amx_gemm.c)."""
        assert weight.dtype == self.dtype and weight.device.type == "cpu", weight.dtype
        assert weight.stride(1) == 1, f"weight rows not dense: strides {weight.stride()}"
        out_features, in_features = weight.shape
        assert self.handles(in_features), f"in_features {in_features} not whole tiles"
        panels = -(-out_features // PANEL)
        packed = torch.empty(panels, in_features, PANEL, dtype=self.dtype)
        self._pack(
            weight.data_ptr(), weight.stride(0), out_features, in_features, packed.data_ptr()
        )
        return packed

    def linear(
        self,
        x: torch.Tensor,  # [T, in]
        packed: torch.Tensor,  # from pack()
        out_features: int,
        bias: torch.Tensor | None,
        op: str = "none",  # one of OPS
        other: torch.Tensor | None = None,  # [T, out] for "mul" and "add"
    ) -> torch.Tensor:
        in_features = packed.shape[1]
        if x.stride(-1) != 1:
            x = x.contiguous()
        if other is not None and other.stride(-1) != 1:
            other = other.contiguous()
        # The C side trusts every pointer and stride it gets: check them here.
        assert x.dim() == 2 and x.shape[1] == in_features, f"x {tuple(x.shape)}, in {in_features}"
        assert x.dtype == self.dtype and x.device.type == "cpu", f"x {x.dtype} {x.device}"
        assert (other is None) == (op in ("none", "swish", "swiglu")), f"op {op!r}, {other=}"
        if other is not None:
            assert other.shape == (x.shape[0], out_features), f"other {tuple(other.shape)}"
            assert other.dtype == self.dtype, f"other {other.dtype}"
        if bias is not None:
            assert bias.shape == (out_features,) and bias.is_contiguous(), "bias not [out] dense"
            assert bias.dtype == self.dtype, f"bias {bias.dtype}"
        # swiglu: the weight's rows pair gate and up groups (swiglu_rows), half as many outputs
        width = out_features // 2 if op == "swiglu" else out_features
        assert op != "swiglu" or out_features % PANEL == 0, f"swiglu on {out_features} rows"
        rows = x.shape[0]
        y = torch.empty(rows, width, dtype=self.dtype)
        self.linear_into(
            x.data_ptr(), x.stride(0), rows, packed, out_features, bias, OPS[op],
            0 if other is None else other.data_ptr(), 0 if other is None else other.stride(0),
            y.data_ptr(), width, torch.get_num_threads(),
        )  # fmt: skip
        return y

    def linear_into(
        self,
        x: int,  # address of [rows, in] elements, rows x_stride apart
        x_stride: int,
        rows: int,
        packed: torch.Tensor,  # from pack()
        out_features: int,
        bias: torch.Tensor | None,
        op: int,  # OPS[name]
        other: int,  # address of [rows, out] for "mul"/"add" (0 otherwise)
        other_stride: int,
        y: int,  # address of [rows, width] outputs, rows y_stride apart
        y_stride: int,
        threads: int,
    ) -> None:
        """:meth:`linear` on addresses, unchecked: for a caller that checked its buffers once
        (``engine/model/native_step.py``)."""
        self._linear(
            x, x_stride, rows, packed.shape[1], packed.data_ptr(), out_features,
            0 if bias is None else bias.data_ptr(), op, other, other_stride, y, y_stride, threads,
        )  # fmt: skip


def swiglu_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The rows (or bias entries) of ``gate`` and ``up`` in groups of 16 alternating, gate
    first: the weight of the "swiglu" op, whose every 32-column panel then holds 16 gate
    columns and the matching 16 up ones. Their count must be a multiple of 16."""
    assert gate.shape == up.shape and gate.shape[0] % SWIGLU_GROUP == 0, f"{tuple(gate.shape)}"
    rest = gate.shape[1:]
    pairs = torch.stack(
        (gate.reshape(-1, SWIGLU_GROUP, *rest), up.reshape(-1, SWIGLU_GROUP, *rest)), 1
    )
    return pairs.reshape(2 * gate.shape[0], *rest)


def gemm_for(dtype: torch.dtype) -> PackedGemm | None:
    """Our GEMM for weights of ``dtype``, or None (oneDNN's, the reason logged once)."""
    if dtype == torch.float32:
        return load_packed_gemm()
    if dtype != torch.bfloat16:
        return None
    return load_amx_gemm() or load_avx512_bf16_gemm()


@functools.cache
def load_packed_gemm() -> PackedGemm | None:
    """The fp32 GEMM, building it on first use; None (reason logged) when it cannot be built."""
    library = load_library(SOURCE, CFLAGS, "native fp32 GEMM")
    if library is None:
        return None
    return PackedGemm(library, torch.float32, "pdserve_pack_weight", "pdserve_linear", 1)


@functools.cache
def load_amx_gemm() -> PackedGemm | None:
    """The bf16 AMX GEMM, building it on first use; None (reason logged) when it cannot be
    built or this CPU (or kernel) offers no AMX."""
    # A tile row is 32 bf16 values of K (amx_gemm.c's KSTEP).
    return _load_bf16_gemm(AMX_SOURCE, "amx", "AMX tiles (or not granted)", k_multiple=32)


@functools.cache
def load_avx512_bf16_gemm() -> PackedGemm | None:
    """The bf16 GEMM on AVX-512 BF16 vectors, building it on first use; None (reason logged)
    when it cannot be built or this CPU has no AVX-512 BF16."""
    # vdpbf16ps takes K in pairs (bf16_panels.h).
    return _load_bf16_gemm(AVX512_BF16_SOURCE, "avx512_bf16", "AVX-512 BF16", k_multiple=2)


def _load_bf16_gemm(source: Path, name: str, feature: str, k_multiple: int) -> PackedGemm | None:
    """A bf16 GEMM exporting ``pdserve_{name}_init`` (0 when this CPU runs it) and
    ``pdserve_{name}_linear``, with bf16_panels.h's packing."""
    library = load_library(source, CFLAGS, f"native bf16 GEMM {source.name}")
    if library is None:
        return None
    init = getattr(library, f"pdserve_{name}_init")
    init.restype = ctypes.c_int
    if init() != 0:
        log.info("no %s on this CPU: %s is not used", feature, source.name)
        return None
    linear = f"pdserve_{name}_linear"
    return PackedGemm(library, torch.bfloat16, "pdserve_bf16_pack", linear, k_multiple)
