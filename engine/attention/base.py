"""The attention backend interface and the per-step metadata the runner builds once.

The KV pool is one tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, row]``
(2 = K then V; a row is ``head_dim`` values, or in an int8 pool int8 values and their scale:
``kv_format.py``). Position ``p`` of a sequence lives in block ``block_table[p // block_size]``
at offset ``p % block_size``; its *slot* is ``block * block_size + offset``::

    block_table = (7, 2)            block_size = 4, context of 6 tokens
    positions     0  1  2  3 | 4  5
    block         7  7  7  7 | 2  2
    slot         28 29 30 31 | 8  9

A step is a FLAT batch: the tokens of every scheduled chunk back to back. Chunk ``i`` owns
tokens ``query_start_loc[i] .. query_start_loc[i+1]`` and, after the step, attends over
positions ``0 .. context_lens[i] - 1`` (``start_positions[i]`` of them were cached before).

A *tree chunk* (speculative verification, ``engine/scheduler/token_tree.py``) has
``row_parents``: row ``r`` sits at position ``start + depth(r)`` and attends to the cached
prefix and to its ancestor rows only, while its K/V still goes to slot ``start + r``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from pdserve.engine.attention.kv_format import kv_format_of

if TYPE_CHECKING:
    from pdserve.engine.attention.native import BoundDecode


class ChunkLike(Protocol):
    """What attention needs from a scheduled chunk (``ScheduledChunk`` satisfies it)."""

    @property
    def start_pos(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def block_table(self) -> tuple[int, ...]: ...

    @property
    def row_parents(self) -> tuple[int, ...]: ...


@dataclass(slots=True, frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step, built once and shared by every layer.

    ``backend`` is the backend that built it (the model calls ``attn.backend.forward``);
    ``backend_data`` holds that backend's precomputed index tensors.
    """

    num_tokens: int
    block_size: int
    query_start_loc: tuple[int, ...]  # [num_chunks + 1]
    start_positions: tuple[int, ...]  # [num_chunks]
    context_lens: tuple[int, ...]  # [num_chunks], start_pos + num_tokens
    block_tables: tuple[tuple[int, ...], ...]  # trimmed to the blocks the context uses
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    write_rows: torch.Tensor  # [2, num_tokens] int64: layer-0 pool rows (see pool_write_rows)
    backend: AttentionBackend
    backend_data: object

    @property
    def num_chunks(self) -> int:
        return len(self.start_positions)


class AttentionBackend(Protocol):
    """Paged attention over the block-major KV pool.

    Backends subclass it explicitly, so that they inherit the defaults below.
    """

    name: str

    def build_metadata(
        self, layout: StepLayout, block_size: int, num_layers: int, device: torch.device
    ) -> AttentionMetadata:
        """Precompute this step's indices (called once per step by the runner)."""
        ...

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # the pool, see module docstring
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        """Write new K/V into the pool and attend; returns ``[num_tokens, heads * head_dim]``."""
        ...

    def bind_native_decode(
        self, attn: AttentionMetadata, kv_cache: torch.Tensor, dtype: torch.dtype, num_heads: int
    ) -> BoundDecode | None:
        """For a step of decode tokens only, on a backend whose C kernel stores and attends:
        its calls on addresses (``engine/model/native_step.py`` runs the layers on them, in
        ``dtype``); else None (the model's modules call :meth:`forward`). By default None:
        a backend without such a kernel."""
        return None


@dataclass(slots=True, frozen=True)
class StepLayout:
    """The backend-independent part of :class:`AttentionMetadata`, in plain Python."""

    query_start_loc: tuple[int, ...]
    start_positions: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    # Per chunk: the parent row of each row (-1 = the root) for a tree chunk, else ().
    row_parents: tuple[tuple[int, ...], ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def tree_parents(self, chunk: int) -> tuple[int, ...]:
        return self.row_parents[chunk] if self.row_parents else ()


def layout_chunks(chunks: Sequence[ChunkLike], block_size: int) -> StepLayout:
    """Offsets, context lengths and trimmed block tables; ValueError on a too-short table."""
    starts: list[int] = [0]
    context_lens: list[int] = []
    tables: list[tuple[int, ...]] = []
    for chunk in chunks:
        context_len = chunk.start_pos + chunk.num_tokens
        blocks_needed = -(-context_len // block_size)
        if len(chunk.block_table) < blocks_needed:
            raise ValueError(
                f"block table has {len(chunk.block_table)} blocks but context of "
                f"{context_len} tokens needs {blocks_needed} (block_size {block_size})"
            )
        starts.append(starts[-1] + chunk.num_tokens)
        context_lens.append(context_len)
        tables.append(tuple(chunk.block_table[:blocks_needed]))
    parents = tuple(c.row_parents for c in chunks)
    return StepLayout(
        query_start_loc=tuple(starts),
        start_positions=tuple(c.start_pos for c in chunks),
        context_lens=tuple(context_lens),
        block_tables=tuple(tables),
        row_parents=parents if any(parents) else (),
    )


def step_metadata(
    layout: StepLayout,
    block_size: int,
    num_layers: int,
    device: torch.device,
    backend: AttentionBackend,
    backend_data: object,
) -> AttentionMetadata:
    """The metadata every backend shares (slots and K/V write rows) around ``backend_data``."""
    slots = torch.tensor(slot_mapping(layout, block_size), dtype=torch.int64, device=device)
    return AttentionMetadata(
        num_tokens=layout.num_tokens,
        block_size=block_size,
        query_start_loc=layout.query_start_loc,
        start_positions=layout.start_positions,
        context_lens=layout.context_lens,
        block_tables=layout.block_tables,
        slot_mapping=slots,
        write_rows=pool_write_rows(slots, block_size, num_layers),
        backend=backend,
        backend_data=backend_data,
    )


def token_positions(layout: StepLayout) -> list[int]:
    """Absolute position of every token of the flat batch, chunk after chunk."""
    positions: list[int] = []
    for i, (start, end) in enumerate(zip(layout.start_positions, layout.context_lens, strict=True)):
        if end - start == 1:
            positions.append(start)
        elif parents := layout.tree_parents(i):
            positions.extend(start + depth for depth in row_depths(parents))
        else:
            positions.extend(range(start, end))
    return positions


def row_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each row of a tree chunk below its root row (parents precede children)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def tree_ancestors(parents: Sequence[int]) -> list[int]:
    """Per row of a tree chunk, a bitmask of the rows it attends to: bit ``c`` is set when
    row ``c`` is the row itself or one of its ancestors (parents precede children)."""
    bits: list[int] = []
    for row, parent in enumerate(parents):
        bits.append((bits[parent] if parent >= 0 else 0) | 1 << row)
    return bits


def tree_mask(parents: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[n, n]`` bool: row ``r`` may attend to row ``c`` (``c`` is ``r`` or an ancestor)."""
    n = len(parents)
    rows = [[bool(bits >> c & 1) for c in range(n)] for bits in tree_ancestors(parents)]
    return torch.tensor(rows, dtype=torch.bool, device=device)


def slot_mapping(layout: StepLayout, block_size: int) -> list[int]:
    """``slot = block_table[pos // block_size] * block_size + pos % block_size`` per token."""
    slots: list[int] = []
    for start, end, table in zip(
        layout.start_positions, layout.context_lens, layout.block_tables, strict=True
    ):
        if end - start == 1:  # decode: the common case, kept cheap
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            slots.extend(
                table[p // block_size] * block_size + p % block_size for p in range(start, end)
            )
    return slots


def pool_write_rows(slots: torch.Tensor, block_size: int, num_layers: int) -> torch.Tensor:
    """Layer-0 rows of K and V for each slot in the pool viewed as ``[-1, kv_heads, head_dim]``.

    Row of (block b, layer l, kv, offset o) is ``((b * L + l) * 2 + kv) * block_size + o``;
    layer ``l`` adds ``2 * l * block_size``. Returns ``[2, num_tokens]`` (K rows, V rows).
    """
    k_rows = (slots // block_size) * (num_layers * 2 * block_size) + slots % block_size
    return torch.stack((k_rows, k_rows + block_size))


def write_kv(
    kv_cache: torch.Tensor, layer_idx: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store this step's K/V (``[T, kv_heads, head_dim]`` each) at precomputed pool rows, in
    the pool's format (an int8 pool quantizes them: ``kv_format.py``)."""
    block_size, kv_heads, row = kv_cache.shape[3:]
    kv_format = kv_format_of(kv_cache)
    write_view = kv_cache.view(-1, kv_heads, row)
    layer_rows = rows + layer_idx * 2 * block_size  # [2, T]
    write_view.index_copy_(0, layer_rows[0], kv_format.to_rows(k))
    write_view.index_copy_(0, layer_rows[1], kv_format.to_rows(v))
