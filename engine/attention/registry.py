"""Pick an attention backend by name; heavy backends are built (and imported) lazily."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.attention.cpu import CpuAttentionBackend
from pdserve.engine.attention.native import load_paged_decode


def _cpu_best() -> AttentionBackend:
    """The native decode kernel when it builds here, else the best pure-torch strategy."""
    return CpuAttentionBackend("native" if load_paged_decode() is not None else "grouped")


def _cuda() -> AttentionBackend:
    from pdserve.engine.attention.cuda import make_flash_attn_backend

    return make_flash_attn_backend()


# "cpu" is the measured winner: native decode kernel, else grouped (engine/attention/cpu.py).
_FACTORIES: dict[str, Callable[[], AttentionBackend]] = {
    "cpu": _cpu_best,
    "cpu-native": lambda: CpuAttentionBackend("native"),
    "cpu-grouped": lambda: CpuAttentionBackend("grouped"),
    "cpu-padded": lambda: CpuAttentionBackend("padded"),
    "cpu-per-seq": lambda: CpuAttentionBackend("per_seq"),
    "flash_attn": _cuda,
}


def backend_names() -> tuple[str, ...]:
    return ("auto", *_FACTORIES)


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """Build the backend called ``name``; ``auto`` picks by device (CUDA -> flash_attn)."""
    if name == "auto":
        name = "flash_attn" if torch.device(device).type == "cuda" else "cpu"
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {backend_names()}")
    return factory()
