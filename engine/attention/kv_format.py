"""What the KV pool's elements are: the model's dtype, or int8 rows with a scale each.

The pool is ``[num_blocks, num_layers, 2, block_size, num_kv_heads, row]`` (``base.py``) where
a *row* is one token's K or V of one kv head. A :class:`KVFormat` says what a row holds:

* ``float32`` / ``bfloat16``: ``head_dim`` values, the model's dtype (``kv_cache_dtype="auto"``);
* ``int8``: ``head_dim`` int8 values then their bf16 scale, ``head_dim + 2`` bytes
  (``kv_codec/int8_rows.py``): about half the bytes of bf16, so twice the tokens per pool.

The format follows from the pool tensor's dtype (:func:`kv_format_of`), so code that holds the
pool needs no other argument to know it; attention backends and kernels ask it how to write
rows (:meth:`KVFormat.to_rows`) and read them back (:meth:`KVFormat.from_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.config import KV_CACHE_DTYPES
from pdserve.kv_codec import ROW_SCALE_BYTES, dequantize_rows, quantize_rows


@dataclass(slots=True, frozen=True)
class KVFormat:
    """The element format of a KV pool (see the module docstring)."""

    name: str
    pool_dtype: torch.dtype  # the pool tensor's dtype
    kernel_code: int  # how the C kernels name it (paged_decode.c, paged_prefill.c)

    @property
    def quantized(self) -> bool:
        return self.pool_dtype == torch.int8

    @property
    def scale_bytes(self) -> int:
        """Bytes after a row's values (its scale): 0 unless quantized."""
        return ROW_SCALE_BYTES if self.quantized else 0

    def row_elems(self, head_dim: int) -> int:
        """Elements of one pool row holding ``head_dim`` values."""
        return head_dim + self.scale_bytes

    def head_dim(self, pool: torch.Tensor) -> int:
        """Values per row of ``pool``."""
        return int(pool.shape[-1]) - self.scale_bytes

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [..., head_dim]`` as pool rows (``x`` itself when the pool holds its dtype)."""
        if self.quantized:
            return quantize_rows(x)
        assert x.dtype == self.pool_dtype, f"{x.dtype} K/V for a {self.name} pool"
        return x

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [..., head_dim]`` as the pool gives it back once stored (an int8 pool rounds
        it), in ``x``'s dtype: what attention over the pool sees of it."""
        return self.from_rows(self.to_rows(x), x.dtype) if self.quantized else x

    def from_rows(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Pool rows ``[..., row]`` as values ``[..., head_dim]`` in ``dtype`` (``rows``
        itself, unquantized, when the pool holds ``dtype``)."""
        if self.quantized:
            return dequantize_rows(rows, dtype)
        return rows if rows.dtype == dtype else rows.to(dtype)


FLOAT32 = KVFormat("float32", torch.float32, 0)
BFLOAT16 = KVFormat("bfloat16", torch.bfloat16, 1)
INT8 = KVFormat("int8", torch.int8, 2)
_BY_DTYPE = {f.pool_dtype: f for f in (FLOAT32, BFLOAT16, INT8)}


def kv_format_of(pool: torch.Tensor) -> KVFormat:
    """The format of a pool, by its dtype."""
    return kv_format_for(pool.dtype)


def kv_format_for(pool_dtype: torch.dtype) -> KVFormat:
    """The format of a pool of ``pool_dtype`` (int8: int8 rows with a scale each)."""
    found = _BY_DTYPE.get(pool_dtype)
    if found is None:
        raise ValueError(f"a KV pool holds float32, bfloat16 or int8, not {pool_dtype}")
    return found


def resolve_kv_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """``"auto"``: the model's dtype; ``"int8"``: int8 rows; else ValueError."""
    if kv_cache_dtype == "int8":
        return INT8
    if kv_cache_dtype == "auto" and model_dtype in _BY_DTYPE:
        return _BY_DTYPE[model_dtype]
    raise ValueError(
        f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} (with a float32 or bfloat16 "
        f"model), got {kv_cache_dtype!r} for a {model_dtype} model"
    )
