"""Steps of paged attention for the backends' tests: chunks with random, disjoint block
tables over a pool of noise, each chunk's true K/V (before they went through the pool) and
the step's queries.

Each test module picks its own :class:`PoolShape` and writes its own reference; what is
shared is how a step is drawn, so that the same seed gives the same step everywhere.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Chunk:
    """A scheduled chunk as attention sees it (satisfies ``ChunkLike``)."""

    start_pos: int
    num_tokens: int
    block_table: tuple[int, ...]
    row_parents: tuple[int, ...] = ()


@dataclass(frozen=True)
class PoolShape:
    """The pool ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`` and the
    query heads of a test module's steps."""

    num_blocks: int
    num_layers: int
    block_size: int
    kv_heads: int
    heads: int
    head_dim: int


@dataclass
class Case:
    """One step: ``keys``/``values`` per chunk are ``[context_len, KVH, D]``, the true K/V of
    every position (the cached prefix, then the step's own tokens)."""

    chunks: list[Chunk]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    q: torch.Tensor  # [T, H, D]
    pool: torch.Tensor  # [num_blocks, L, 2, block_size, KVH, D]

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's own K and V, ``[T, KVH, D]`` each, in flat-batch order."""
        ks = [k[c.start_pos :] for c, k in zip(self.chunks, self.keys, strict=True)]
        vs = [v[c.start_pos :] for c, v in zip(self.chunks, self.values, strict=True)]
        return torch.cat(ks), torch.cat(vs)

    def to(self, dtype: torch.dtype) -> Case:
        """Every tensor rounded to ``dtype`` (the chunks shared)."""
        return Case(
            self.chunks,
            [k.to(dtype) for k in self.keys],
            [v.to(dtype) for v in self.values],
            self.q.to(dtype),
            self.pool.to(dtype),
        )

    def rows(self, cached: bool) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """``(block, offset, k, v)`` of each cached prefix position (``cached``), or of each
        of the step's own tokens: where its K/V row sits in the pool, and what it is."""
        block_size = self.pool.shape[3]
        for chunk, k, v in zip(self.chunks, self.keys, self.values, strict=True):
            first, end = (0, chunk.start_pos) if cached else (chunk.start_pos, len(k))
            for p in range(first, end):
                yield chunk.block_table[p // block_size], p % block_size, k[p], v[p]

    def write_cached_prefix(self, layer: int) -> None:
        """Store each chunk's cached prefix into the pool's ``layer``."""
        for block, offset, k, v in self.rows(cached=True):
            self.pool[block, layer, 0, offset] = k
            self.pool[block, layer, 1, offset] = v


def make_case(
    shape: PoolShape,
    spans: list[tuple[int, int]],
    seed: int,
    dtype: torch.dtype = torch.float32,
    parents: tuple[int, ...] = (),
) -> Case:
    """``spans`` = (start_pos, num_tokens) per chunk, random disjoint block tables with one
    spare block each (tables may be longer than the context needs); ``parents`` makes the
    LAST chunk a token tree. The pool is noise: no prefix is written yet."""
    gen = torch.Generator().manual_seed(seed)
    free_blocks = list(range(shape.num_blocks))
    random.Random(seed).shuffle(free_blocks)
    pool_shape = (shape.num_blocks, shape.num_layers, 2, shape.block_size)
    pool = torch.randn(*pool_shape, shape.kv_heads, shape.head_dim, generator=gen).to(dtype)
    chunks, keys, values = [], [], []
    for i, (start, n) in enumerate(spans):
        num_blocks = -(-(start + n) // shape.block_size) + 1
        table = tuple(free_blocks.pop() for _ in range(num_blocks))
        chunks.append(Chunk(start, n, table, parents if i == len(spans) - 1 else ()))
        for into in (keys, values):
            kv = torch.randn(start + n, shape.kv_heads, shape.head_dim, generator=gen)
            into.append(kv.to(dtype))
    num_tokens = sum(n for _, n in spans)
    q = torch.randn(num_tokens, shape.heads, shape.head_dim, generator=gen).to(dtype)
    return Case(chunks, keys, values, q, pool)
