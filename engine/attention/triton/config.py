"""The tile sizes of the attention kernels, one frozen config for the backend."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class TritonTiles:
    """Tile sizes of the kernels (powers of two of at least 16: ``tl.dot``'s minimum).

    The defaults are first guesses for a GPU, NOT tuned: these kernels have not yet run on
    one. Tests shrink them so small shapes still cross tiles and splits.
    """

    query_rows: int = 64  # prefill tile rows: query tokens times the heads of a kv group
    key_tokens: int = 64  # keys per inner step, both kernels
    split_tokens: int = 512  # about this many keys per decode split
    max_splits: int = 16
    # Warps per program of both attention kernels: with 4, ptxas spills registers at the
    # default tiles (Triton 3.9, sm_90, head_dim 128); with 8 it does not.
    num_warps: int = 8

    def __post_init__(self) -> None:
        for name in ("query_rows", "key_tokens"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.split_tokens < 1 or self.max_splits < 1:
            raise ValueError(
                f"split_tokens and max_splits must be >= 1, got {self.split_tokens}, "
                f"{self.max_splits}"
            )
