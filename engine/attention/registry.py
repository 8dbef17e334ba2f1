"""Pick an attention backend by name; heavy backends are built (and imported) lazily."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.attention.cpu import CpuAttentionBackend
from pdserve.engine.attention.native import load_paged_decode


def _cpu_best() -> AttentionBackend:
    """The native decode kernel when it builds here, else the best pure-torch strategy."""
    return CpuAttentionBackend("native" if load_paged_decode() is not None else "grouped")


def _flash_attn() -> AttentionBackend:
    from pdserve.engine.attention.cuda import make_flash_attn_backend

    return make_flash_attn_backend()


def _cuda_triton() -> AttentionBackend:
    from pdserve.engine.attention.triton import make_triton_backend

    return make_triton_backend()


# "cpu" is the measured winner: native decode kernel, else grouped (engine/attention/cpu.py).
_FACTORIES: dict[str, Callable[[], AttentionBackend]] = {
    "cpu": _cpu_best,
    "cpu-native": lambda: CpuAttentionBackend("native"),
    "cpu-grouped": lambda: CpuAttentionBackend("grouped"),
    "cpu-padded": lambda: CpuAttentionBackend("padded"),
    "cpu-per-seq": lambda: CpuAttentionBackend("per_seq"),
    "flash_attn": _flash_attn,
    "cuda-triton": _cuda_triton,
}


def backend_names() -> tuple[str, ...]:
    return ("auto", *_FACTORIES)


def get_backend(
    name: str = "auto", device: torch.device | str = "cpu", block_size: int | None = None
) -> AttentionBackend:
    """Build the backend called ``name``; ``auto`` picks by device (see :func:`auto_backend`)."""
    if name == "auto":
        name = auto_backend(torch.device(device), block_size)
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {backend_names()}")
    return factory()


def auto_backend(device: torch.device, block_size: int | None) -> str:
    """``cpu`` on CPU. On CUDA ``cuda-triton``, or ``flash_attn`` when its package is
    installed and the pool's ``block_size`` is one it reads in place (a multiple of 256)."""
    if device.type != "cuda":
        return "cpu"
    from pdserve.engine.attention.cuda import flash_attn_reads_blocks_of

    suits_flash_attn = block_size is not None and flash_attn_reads_blocks_of(block_size)
    if suits_flash_attn and importlib.util.find_spec("flash_attn") is not None:  # not imported
        return "flash_attn"
    return "cuda-triton"
