"""The tile sizes of the attention kernels, one frozen config for the backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class TritonTiles:
    """Tile sizes of the kernels (powers of two of at least 16: ``tl.dot``'s minimum).

    The defaults are first guesses for a GPU, NOT tuned: these kernels have not yet run on
    one; they are the largest at which ptxas (Triton 3.9, sm_90, head_dim 128) compiles the
    kernels without spilling registers (over an int8 pool, the dequantization spills under
    100 bytes). Tests shrink them so small shapes still cross tiles and splits.
    """

    query_rows: int = 64  # prefill tile rows: query tokens times the heads of a kv group
    key_tokens: int = 64  # keys per inner step, both kernels, for 16-bit queries
    key_tokens_fp32: int = 32  # the same for fp32 queries: their products run on FMA units
    split_tokens: int = 512  # about this many keys per decode split
    max_splits: int = 16
    num_warps: int = 8  # per program of both attention kernels (with 4, registers spill)

    def __post_init__(self) -> None:
        for name in ("query_rows", "key_tokens", "key_tokens_fp32"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.split_tokens < 1 or self.max_splits < 1:
            raise ValueError(
                f"split_tokens and max_splits must be >= 1, got {self.split_tokens}, "
                f"{self.max_splits}"
            )

    def key_tile(self, dtype: torch.dtype) -> int:
        """Keys per inner step for queries of ``dtype``."""
        return self.key_tokens_fp32 if dtype == torch.float32 else self.key_tokens
