"""Per-step index tensors of the CPU backend, built once per step and shared by all layers.

Rows refer to the pool's *gather view* ``[num_blocks * L * 2, block_size, kv_heads, D]``,
where (block b, layer l, K|V kv) is row ``(b * L + l) * 2 + kv``. They are stored for layer
0; layer ``l`` adds ``2 * l``.

Decode tokens (one-token chunks) are sorted by context length and cut into groups whose
gathered K/V stays under a byte budget, so a group's gather buffer is still in cache when
SDPA reads it, and padding stays small::

    context lens (sorted)   37  40  41 | 90  96 | 300
    group                   [   g0    ] [ g1   ] [g2]     each padded to its longest member
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.attention.base import StepLayout, tree_ancestors, tree_mask


@dataclass(slots=True, frozen=True)
class DecodeGroup:
    """Decode sequences attended in one SDPA call over one gather."""

    num_seqs: int
    gather_rows: torch.Tensor  # [num_seqs * 2 * width_blocks]: per seq, K blocks then V blocks
    width_tokens: int  # padded key length, a multiple of block_size
    context_len: int | None  # set when every member has this length: slice, no mask
    key_mask: torch.Tensor | None  # [num_seqs, 1, 1, width_tokens] bool, True = attend


@dataclass(slots=True, frozen=True)
class DecodePlan:
    """All one-token chunks of a step, in groups."""

    num_seqs: int
    # Flat-batch rows of the decode tokens in group order; None when that is rows 0..B-1.
    token_rows: torch.Tensor | None
    groups: tuple[DecodeGroup, ...]


@dataclass(slots=True, frozen=True)
class NativeDecodePlan:
    """All one-token chunks of a step, for the native kernel (``engine/attention/native.py``)."""

    num_seqs: int
    tables: torch.Tensor  # [num_seqs, width] int32 block ids; the tail past a context is unread
    lens: torch.Tensor  # [num_seqs] int32 context lengths (the new token included)
    q_rows: torch.Tensor | None  # [num_seqs] int32 flat-batch rows; None when rows 0..B-1
    max_block_id: int  # checked against the pool before the kernel dereferences any id


@dataclass(slots=True, frozen=True)
class PrefillPlan:
    """One multi-token chunk: for the native kernel (``engine/attention/paged_prefill.py``) its
    block table, for torch's (``engine/attention/cpu_prefill.py``) the rows of its prefix."""

    token_start: int
    token_end: int
    prefix_len: int  # cached positions before the chunk (its start_pos)
    gather_rows: torch.Tensor | None  # [2 * prefix blocks]; None when prefix_len == 0
    table: torch.Tensor  # [blocks up to the chunk's end] int32
    max_block_id: int  # checked against the pool before the kernel dereferences any id
    # A tree chunk (speculative verification), for torch: [n, n] bool, True = may attend;
    # for the native kernel: [n] int64, bit c of row r set when r attends to row c.
    tree_mask: torch.Tensor | None = None
    tree_ancestors: torch.Tensor | None = None


def plan_native_decodes(layout: StepLayout, device: torch.device) -> NativeDecodePlan | None:
    """The one-token chunks, and every row of a chain chunk (see :func:`is_chain`), as padded
    int32 tables for the native kernel, longest context first; None if there are none.

    A chain's row ``r`` is a decode query over ``start + r + 1`` positions: the kernel stores
    every row's K/V before any row attends, so the rows before it are in place.

    Why longest first: the kernel's threads take sequences in this order as each finishes one,
    so the step's attention ends on short sequences rather than with one thread reading a long
    one while the other waits (longest-processing-time-first scheduling). Measured on the
    kernel alone (bf16, 30 layers, random block ids, contexts 75-1,500, two threads, medians of
    15 alternating runs): 8 sequences 1.07x faster, 16-32 1.01x, 48 level.
    """
    queries = sorted(_decode_queries(layout), key=lambda query: -query[1])
    if not queries:
        return None
    tables = [table for _, _, table in queries]
    width = max(len(t) for t in tables)
    rows = [row for row, _, _ in queries]
    in_place = rows == list(range(len(rows)))
    return NativeDecodePlan(
        num_seqs=len(queries),
        tables=torch.tensor(
            [t + (0,) * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        lens=torch.tensor([n for _, n, _ in queries], dtype=torch.int32, device=device),
        q_rows=None if in_place else torch.tensor(rows, dtype=torch.int32, device=device),
        max_block_id=max(max(t) for t in tables),
    )


def is_chain(layout: StepLayout, i: int) -> bool:
    """Chunk ``i`` is a tree chunk whose rows form one chain: causal, like a prefill chunk."""
    parents = layout.tree_parents(i)
    return bool(parents) and all(p == r - 1 for r, p in enumerate(parents))


def _decode_queries(layout: StepLayout) -> list[tuple[int, int, tuple[int, ...]]]:
    """(flat-batch row, context length, block table) of each one-token chunk and chain row."""
    queries = []
    for i, (start, table) in enumerate(
        zip(layout.start_positions, layout.block_tables, strict=True)
    ):
        first = layout.query_start_loc[i]
        if _chunk_len(layout, i) == 1:
            queries.append((first, start + 1, table))
        elif is_chain(layout, i):
            queries.extend((first + r, start + r + 1, table) for r in range(_chunk_len(layout, i)))
    return queries


def plan_decodes(
    layout: StepLayout,
    block_size: int,
    num_layers: int,
    group_budget_tokens: float,
    device: torch.device,
) -> DecodePlan | None:
    """Group the one-token chunks; ``group_budget_tokens`` caps ``members * padded width``."""
    ids = _decode_ids(layout)
    if not ids:
        return None
    widest = max(len(layout.block_tables[i]) for i in ids) * block_size
    if 0 < group_budget_tokens < len(ids) * widest:
        # Several groups: neighbours in length share a group, so padding stays small.
        ids.sort(key=lambda i: layout.context_lens[i])
    rows = [layout.query_start_loc[i] for i in ids]
    groups = [
        _decode_group(layout, members, block_size, num_layers, device)
        for members in _split(ids, layout, block_size, group_budget_tokens)
    ]
    in_place = rows == list(range(len(rows)))
    return DecodePlan(
        num_seqs=len(ids),
        token_rows=None if in_place else torch.tensor(rows, dtype=torch.int64, device=device),
        groups=tuple(groups),
    )


def _decode_ids(layout: StepLayout) -> list[int]:
    return [i for i in range(len(layout.context_lens)) if _chunk_len(layout, i) == 1]


def _chunk_len(layout: StepLayout, i: int) -> int:
    return layout.query_start_loc[i + 1] - layout.query_start_loc[i]


def _split(
    ids: list[int], layout: StepLayout, block_size: int, budget_tokens: float
) -> list[list[int]]:
    """Greedy cut of length-sorted ids: a group grows while members * width fits the budget."""
    groups: list[list[int]] = []
    current: list[int] = []
    for i in ids:
        width = -(-layout.context_lens[i] // block_size) * block_size  # the longest so far
        if current and (len(current) + 1) * width > budget_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def _decode_group(
    layout: StepLayout,
    members: Sequence[int],
    block_size: int,
    num_layers: int,
    device: torch.device,
) -> DecodeGroup:
    lens = [layout.context_lens[i] for i in members]
    width = max(len(layout.block_tables[i]) for i in members)
    rows: list[int] = []
    for i in members:
        table = layout.block_tables[i]
        table = table + (table[0],) * (width - len(table))  # padding reads a real block
        rows.extend(gather_rows(table, num_layers))
    uniform = len(set(lens)) == 1
    key_mask = None
    if not uniform:
        positions = torch.arange(width * block_size, device=device)
        key_mask = positions < torch.tensor(lens, device=device)[:, None]
        key_mask = key_mask[:, None, None, :]
    return DecodeGroup(
        num_seqs=len(members),
        gather_rows=torch.tensor(rows, dtype=torch.int64, device=device),
        width_tokens=width * block_size,
        context_len=lens[0] if uniform else None,
        key_mask=key_mask,
    )


def gather_rows(table: Sequence[int], num_layers: int) -> list[int]:
    """Layer-0 gather rows of one block table: all K blocks, then all V blocks."""
    k_rows = [b * num_layers * 2 for b in table]
    return k_rows + [r + 1 for r in k_rows]


def plan_prefills(
    layout: StepLayout,
    block_size: int,
    num_layers: int,
    device: torch.device,
    chains_decode: bool = False,
) -> tuple[PrefillPlan, ...]:
    """The multi-token chunks; ``chains_decode``: without the chains (the native decode plan
    takes their rows)."""
    plans = []
    for i, start_pos in enumerate(layout.start_positions):
        if _chunk_len(layout, i) == 1 or (chains_decode and is_chain(layout, i)):
            continue
        rows = None
        if start_pos > 0:  # the chunk's own K/V come with the step; gather only the prefix
            prefix_blocks = layout.block_tables[i][: -(-start_pos // block_size)]
            rows = torch.tensor(gather_rows(prefix_blocks, num_layers), device=device)
        token_start, token_end = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        parents = layout.tree_parents(i)
        blocks = layout.block_tables[i][: -(-(start_pos + token_end - token_start) // block_size)]
        plans.append(
            PrefillPlan(
                token_start=token_start,
                token_end=token_end,
                prefix_len=start_pos,
                gather_rows=rows,
                table=torch.tensor(blocks, dtype=torch.int32, device=device),
                max_block_id=max(blocks),
                tree_mask=tree_mask(parents, device) if parents else None,
                tree_ancestors=torch.tensor(tree_ancestors(parents), dtype=torch.int64)
                if parents
                else None,
            )
        )
    return tuple(plans)
