"""Pool sizing arithmetic: how many blocks a memory budget buys.

One block holds, for every layer, K then V for ``block_size`` positions (the project-wide
pool layout ``[num_blocks, num_layers, 2, block_size, num_kv_heads, row]``), where a row is
one token's K or V of one kv head: ``head_dim`` values, and in an int8 pool their scale after
them (``engine/attention/kv_format.py``).
"""

from __future__ import annotations


def kv_block_bytes(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    row_scale_bytes: int = 0,
) -> int:
    """Bytes of one block across all layers (K and V): rows of ``head_dim`` values of
    ``dtype_bytes`` each, plus ``row_scale_bytes`` per row (an int8 pool's scale)."""
    dims = {
        "num_layers": num_layers,
        "block_size": block_size,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dtype_bytes": dtype_bytes,
    }
    bad = {name: value for name, value in dims.items() if value < 1}
    if bad or row_scale_bytes < 0:
        raise ValueError(
            f"KV block dimensions must be >= 1 (row_scale_bytes >= 0), got {bad}, "
            f"row_scale_bytes={row_scale_bytes}"
        )
    row_bytes = head_dim * dtype_bytes + row_scale_bytes
    return num_layers * 2 * block_size * num_kv_heads * row_bytes


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """Whole blocks that fit in ``budget_bytes`` (may be 0; the caller decides if that is ok)."""
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be >= 1, got {bytes_per_block}")
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    return budget_bytes // bytes_per_block
