"""The KV pool layout every worker shares, and byte views of its blocks.

One contiguous tensor per worker::

    pool: [num_blocks, num_layers, 2, block_size, num_kv_heads, row]
                       (2 = K then V)

where a row is ``head_dim`` values in the pool's dtype, or in an int8 pool ``head_dim`` int8
values and their bf16 scale (``kv_codec/int8_rows.py``): ``row = head_dim + 2`` bytes.

Block-major, so block ``b`` is the single contiguous byte range
``[b * block_bytes, (b + 1) * block_bytes)`` of the pool: one NIXL descriptor, one socket
read or write per block. Inside a block the bytes run per layer, K then V, which is also the
wire layout (see ``wire.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.kv_codec import ROW_SCALE_BYTES

# Wire codes for the dtypes a pool may hold (int8: rows with a scale each); never renumber
# (they travel between workers).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.bfloat16: 2,
    torch.float16: 3,
    torch.int8: 4,
}
DTYPES_BY_CODE: dict[int, torch.dtype] = {code: dt for dt, code in DTYPE_CODES.items()}
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int8: "int8",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {name: dt for dt, name in DTYPE_NAMES.items()}


@dataclass(slots=True, frozen=True)
class KVPoolLayout:
    """Shape and dtype of a KV pool; ``num_blocks`` may differ between sender and receiver.

    ``head_dim`` counts values: an int8 pool's rows hold a scale after them.
    """

    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of_pool(cls, pool: torch.Tensor) -> KVPoolLayout:
        """The layout of ``pool``; ValueError if it breaks the project's pool contract."""
        if pool.dim() != 6 or pool.shape[2] != 2:
            raise ValueError(
                "KV pool must have shape [num_blocks, num_layers, 2, block_size, "
                f"num_kv_heads, head_dim], got {tuple(pool.shape)}"
            )
        if not pool.is_contiguous():
            raise ValueError(f"KV pool must be contiguous (strides {pool.stride()})")
        if pool.device.type != "cpu":
            raise ValueError(f"KV pool must live in DRAM (cpu), got device {pool.device}")
        if pool.dtype not in DTYPE_CODES:
            raise ValueError(f"KV pool dtype {pool.dtype} unsupported; use one of {_names()}")
        n, layers, _, block_size, heads, row = pool.shape
        head_dim = row - _row_scale_bytes(pool.dtype)
        return cls(n, layers, block_size, heads, head_dim, pool.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block's K/V values: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def pool_block_shape(self) -> tuple[int, int, int, int, int]:
        """One block of the pool tensor: [num_layers, 2, block_size, num_kv_heads, row]."""
        row = self.head_dim + _row_scale_bytes(self.dtype)
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, row)

    @property
    def pool_shape(self) -> tuple[int, ...]:
        return (self.num_blocks, *self.pool_block_shape)

    @property
    def elems_per_block(self) -> int:
        """K/V values per block (scales not counted)."""
        return int(np.prod(self.block_shape))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in the pool (an int8 pool's scales included)."""
        return int(np.prod(self.pool_block_shape)) * self.dtype.itemsize

    def same_block_format(self, other: KVPoolLayout) -> bool:
        """True when a block of ``self`` can be copied byte for byte into ``other``."""
        return self.block_shape == other.block_shape and self.dtype == other.dtype

    def describe(self) -> str:
        return (
            f"layers={self.num_layers} block_size={self.block_size} "
            f"kv_heads={self.num_kv_heads} head_dim={self.head_dim} "
            f"dtype={DTYPE_NAMES[self.dtype]}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "num_blocks": self.num_blocks,
            "num_layers": self.num_layers,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": DTYPE_NAMES[self.dtype],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KVPoolLayout:
        dtype_name = str(data["dtype"])
        if dtype_name not in DTYPES_BY_NAME:
            raise ValueError(f"unknown KV dtype {dtype_name!r}; expected one of {_names()}")
        return cls(
            int(data["num_blocks"]),
            int(data["num_layers"]),
            int(data["block_size"]),
            int(data["num_kv_heads"]),
            int(data["head_dim"]),
            DTYPES_BY_NAME[dtype_name],
        )


def check_block_ids(block_ids: Sequence[int], num_blocks: int, what: str) -> tuple[int, ...]:
    """Validate caller-given block ids: non-empty, in range, no duplicates."""
    ids = tuple(int(b) for b in block_ids)
    if not ids:
        raise ValueError(f"{what}: no block ids given; a transfer moves at least one block")
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{what}: block ids {bad[:8]} out of range [0, {num_blocks})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what}: duplicate block ids in {list(ids)[:16]}")
    return ids


def pool_bytes(pool: torch.Tensor) -> np.ndarray:
    """A uint8 view sharing the pool's memory: [num_blocks, block_bytes]."""
    flat = pool.view(torch.uint8).reshape(pool.shape[0], -1)
    return flat.numpy()


def _names() -> list[str]:
    return sorted(DTYPES_BY_NAME)


def _row_scale_bytes(dtype: torch.dtype) -> int:
    """Bytes after a row's values: an int8 pool's scale, else none."""
    return ROW_SCALE_BYTES if dtype == torch.int8 else 0
