"""Paged attention on CUDA in Triton kernels (FlashAttention-style: tiled, online softmax,
fp32 accumulation) reading the KV pool in place through the block tables.

* ``store.py``: a step's new K/V into their pool slots (an int8 pool is written by
  ``base.write_kv``, which quantizes);
* ``prefill.py``: the multi-token chunks of a step, causal after a cached prefix (or by
  ancestry for a token tree), grouped-query heads packed into one tile;
* ``decode.py``: one query token per sequence, split along the context (split-K), the
  splits merged by log-sum-exp in a second kernel;
* ``tiles.py``: the inner loop both attention kernels share (and an int8 pool's
  dequantization), and the arguments their launches share;
* ``plan.py``: the per-step index tensors, built once per step on the host;
* ``config.py``: the tile sizes (:class:`TritonTiles`);
* ``backend.py``: the :class:`AttentionBackend` over them.

Importing this package imports no Triton: :func:`make_triton_backend` does, with a clear
error when it is missing. The kernels also run under Triton's interpreter
(``TRITON_INTERPRET=1``, read when a kernel module is first imported) on CPU tensors, which
is how the unit tests check them on a machine without a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.attention.triton.config import TritonTiles

if TYPE_CHECKING:
    from pdserve.engine.attention.triton.backend import TritonAttentionBackend

__all__ = ["TritonTiles", "make_triton_backend"]


def make_triton_backend(tiles: TritonTiles | None = None) -> TritonAttentionBackend:
    """Import Triton now (not at package import) and build the backend."""
    try:
        from pdserve.engine.attention.triton.backend import TritonAttentionBackend
    except ImportError as exc:
        raise ValueError(
            f"attention backend 'cuda-triton' needs the triton package ({exc}); install it "
            "(`pip install triton`, Linux x86-64) or use --attention-backend flash_attn or cpu"
        ) from exc
    return TritonAttentionBackend(tiles or TritonTiles())
