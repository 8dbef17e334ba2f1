"""Paged attention on CPU: torch SDPA for prefill chunks, a native kernel (or SDPA) for decode.

Two views of the pool make every index a single integer row (no per-layer slicing):

* write view ``[num_blocks * L * 2 * block_size, kv_heads, head_dim]``: the row of
  (block b, layer l, K|V kv, offset o) is ``((b * L + l) * 2 + kv) * block_size + o``;
* gather view ``[num_blocks * L * 2, block_size, kv_heads, head_dim]``: the row of
  (b, l, kv) is ``(b * L + l) * 2 + kv``.

Rows are precomputed for layer 0 once per step (``cpu_plan.py``); layer ``l`` adds
``2 * l * block_size`` (write) or ``2 * l`` (gather).

Decode tokens (one-token chunks) take one of these strategies:

* ``native``: the C kernel of ``paged_decode.c`` reads each K/V row once, in place in the pool
  (no gather, no padding); the default when it builds (``engine/attention/native.py``). With
  it, prefill chunks run on the C kernel of ``paged_prefill.c``, also in place;
* ``grouped``: length-sorted groups of at most ``group_tokens`` gathered key positions, one
  gather and one SDPA call per group, so a group's gather buffer is still in cache when SDPA
  reads it (the best pure-torch strategy measured);
* ``padded``: one group: every decode sequence padded to the longest, with a length mask;
* ``per_seq``: one sequence per group, no padding and no mask.

Gathers write into one reused scratch buffer: a fresh multi-megabyte tensor per layer costs
more in page faults than the copy itself.

Chunks of several tokens (prefill) run per sequence: with ``native``, on the kernel of
``paged_prefill.c`` (``engine/attention/paged_prefill.py``) in fp32, and in bf16 where the CPU
has no AMX; otherwise with torch's flash kernel, where a chunk starting at position 0 attends
to its own fresh K/V with ``is_causal`` (no gather) and a later chunk gathers only the cached
prefix and merges two unmasked calls (``cpu_prefill.py``). With AMX, bf16 keeps torch's
kernel: it runs bf16 on AMX tiles, faster than our kernel's fp32 arithmetic.

Over an int8 pool (``kv_format.py``) the store quantizes the step's K/V, both native kernels
read the int8 rows and their scales in place, and the torch paths dequantize what they gather
and attend a chunk's own K/V as the pool stored them, as the kernels do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    StepLayout,
    step_metadata,
    write_kv,
)
from pdserve.engine.attention.cpu_plan import (
    DecodeGroup,
    DecodePlan,
    NativeDecodePlan,
    PrefillPlan,
    plan_decodes,
    plan_native_decodes,
    plan_prefills,
)
from pdserve.engine.attention.cpu_prefill import attend_after_prefix, attend_fresh, attend_tree
from pdserve.engine.attention.kv_format import KVFormat, kv_format_of
from pdserve.engine.attention.native import BoundDecode, PagedDecodeKernel, load_paged_decode
from pdserve.engine.attention.paged_prefill import PagedPrefillKernel, load_paged_prefill

DECODE_STRATEGIES = ("native", "grouped", "padded", "per_seq")
DEFAULT_GROUP_TOKENS = 2048


@dataclass(slots=True, frozen=True)
class _CpuStepData:
    decode: DecodePlan | NativeDecodePlan | None
    prefills: tuple[PrefillPlan, ...]


class CpuAttentionBackend(AttentionBackend):
    """Paged attention on CPU; see the module docstring for the decode strategies.

    ``native`` raises ValueError when its kernel cannot be built (the registry's ``cpu``
    picks it only when it builds). Holds a scratch buffer: one backend per runner.
    """

    def __init__(
        self, decode_strategy: str = "grouped", group_tokens: int = DEFAULT_GROUP_TOKENS
    ) -> None:
        if decode_strategy not in DECODE_STRATEGIES:
            raise ValueError(
                f"unknown decode strategy {decode_strategy!r}; choose one of {DECODE_STRATEGIES}"
            )
        if group_tokens < 1:
            raise ValueError(f"group_tokens must be >= 1, got {group_tokens}")
        self._kernel: PagedDecodeKernel | None = None
        self._prefill_kernel: PagedPrefillKernel | None = None
        if decode_strategy == "native":
            self._kernel = load_paged_decode()
            if self._kernel is None:
                raise ValueError(
                    "the native paged decode kernel could not be built (see the warning "
                    "logged above); use attention backend 'cpu-grouped'"
                )
            self._prefill_kernel = load_paged_prefill()  # None: torch's kernel (logged)
        self.decode_strategy = decode_strategy
        self.name = f"cpu-{decode_strategy}".replace("_", "-")
        budgets = {"grouped": float(group_tokens), "padded": float("inf"), "per_seq": 0.0}
        self._group_budget_tokens = budgets.get(decode_strategy, 0.0)
        self._scratch: torch.Tensor | None = None

    def build_metadata(
        self, layout: StepLayout, block_size: int, num_layers: int, device: torch.device
    ) -> AttentionMetadata:
        decode: DecodePlan | NativeDecodePlan | None
        if self._kernel is not None:
            decode = plan_native_decodes(layout, device)
        else:
            budget = self._group_budget_tokens
            decode = plan_decodes(layout, block_size, num_layers, budget, device)
        native = self._kernel is not None
        prefills = plan_prefills(layout, block_size, num_layers, device, chains_decode=native)
        data = _CpuStepData(decode=decode, prefills=prefills)
        return step_metadata(layout, block_size, num_layers, device, self, data)

    def bind_native_decode(
        self, attn: AttentionMetadata, kv_cache: torch.Tensor, dtype: torch.dtype, num_heads: int
    ) -> BoundDecode | None:
        """The native kernels' calls for a step of decode tokens (rows in the plan's order:
        ``q_rows``) and token trees (the prefill kernel by ancestry): None when the step has
        prefill chunks, or runs the torch decode path."""
        data = attn.backend_data
        assert isinstance(data, _CpuStepData), f"metadata built by {attn.backend.name}"
        plan = data.decode
        if self._kernel is None or not isinstance(plan, NativeDecodePlan | None):
            return None
        prefill = self._prefill_kernel
        trees = [c for c in data.prefills if c.tree_ancestors is not None]
        if len(trees) < len(data.prefills) or (trees and prefill is None):
            return None  # prefill chunks in the step, or trees without the prefill kernel
        if trees and not (prefill is not None and prefill.preferred_for(dtype, kv_cache)):
            return None
        if plan is not None:
            assert plan.max_block_id < kv_cache.shape[0], (
                f"block {plan.max_block_id} outside the pool of {kv_cache.shape[0]} blocks"
            )
            bound = self._kernel.bind(
                kv_cache, dtype, num_heads, plan.tables, plan.lens, plan.q_rows, attn.write_rows
            )
        else:
            bound = self._kernel.bind(kv_cache, dtype, num_heads, write_rows=attn.write_rows)
        if not trees:
            return bound
        assert prefill is not None
        for chunk in trees:
            assert chunk.max_block_id < kv_cache.shape[0], "tree block outside the pool"
        more = tuple(
            prefill.bind_tree(
                kv_cache, dtype, num_heads, c.token_start, c.prefix_len, c.table, c.tree_ancestors
            )
            for c in trees
            if c.tree_ancestors is not None
        )
        rows = sum(c.token_end - c.token_start for c in trees)
        return dataclasses.replace(bound, more_rows=more, num_more_rows=rows)

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, row]
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        data = attn.backend_data
        assert isinstance(data, _CpuStepData), f"metadata built by {attn.backend.name}"
        if self._kernel is not None:
            self._kernel.store_kv(kv_cache, layer_idx, attn.write_rows, k, v)
        else:
            write_kv(kv_cache, layer_idx, attn.write_rows, k, v)
        block_size, kv_heads, row = kv_cache.shape[3:]
        gather_rows = kv_cache.view(-1, block_size, kv_heads, row)
        gather_view = _GatherView(gather_rows, layer_idx, kv_format_of(kv_cache))
        decode = data.decode
        if isinstance(decode, DecodePlan) and not data.prefills and decode.token_rows is None:
            return self._decode(q, gather_view, decode)  # [B, H * D]
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # [T, H * D]
        if isinstance(decode, NativeDecodePlan):
            self._native_decode(q, kv_cache, decode, layer_idx, out)
        elif decode is not None:
            decoded = self._decode(q, gather_view, decode)
            if decode.token_rows is None:
                out[: decode.num_seqs] = decoded
            else:
                out.index_copy_(0, decode.token_rows, decoded)
        for chunk in data.prefills:
            span = slice(chunk.token_start, chunk.token_end)
            kernel = self._prefill_kernel
            if kernel is not None and kernel.preferred_for(q.dtype, kv_cache):
                assert chunk.max_block_id < kv_cache.shape[0], (
                    f"block {chunk.max_block_id} outside the pool of {kv_cache.shape[0]} blocks"
                )
                kernel(
                    q[span],
                    kv_cache,
                    chunk.table,
                    chunk.prefix_len,
                    layer_idx,
                    out[span],
                    chunk.tree_ancestors,
                )
            else:
                out[span] = self._prefill(q[span], k[span], v[span], gather_view, chunk)
        return out

    def _native_decode(
        self,
        q: torch.Tensor,  # [T, H, D]
        kv_cache: torch.Tensor,
        plan: NativeDecodePlan,
        layer_idx: int,
        out: torch.Tensor,  # [T, H * D]: the decode rows are written
    ) -> None:
        assert self._kernel is not None, "native decode plan without the kernel"
        assert plan.max_block_id < kv_cache.shape[0], (
            f"block {plan.max_block_id} outside the pool of {kv_cache.shape[0]} blocks"
        )
        self._kernel(q, kv_cache, plan.tables, plan.lens, plan.q_rows, layer_idx, out)

    def _gather(self, view: _GatherView, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The pool rows of layer-0 block rows ``rows`` in ``view``'s layer, as values in
        ``dtype``: ``[len(rows), bs, KVH, D]``. Gathered into the reused scratch buffer (an
        int8 pool's rows are dequantized from there)."""
        pool_rows = view.rows
        n = rows.shape[0]
        scratch = self._scratch
        if (
            scratch is None
            or scratch.shape[0] < n
            or scratch.shape[1:] != pool_rows.shape[1:]
            or scratch.dtype != pool_rows.dtype
        ):
            scratch = pool_rows.new_empty(max(n, 1024), *pool_rows.shape[1:])
            self._scratch = scratch
        gathered = torch.index_select(pool_rows, 0, rows + view.row_offset, out=scratch[:n])
        return view.kv_format.from_rows(gathered, dtype)

    def _decode(self, q: torch.Tensor, view: _GatherView, plan: DecodePlan) -> torch.Tensor:
        # q: [T, H, D] -> the decode rows, in group order: [B, H, D]
        q = q[: plan.num_seqs] if plan.token_rows is None else q.index_select(0, plan.token_rows)
        outs, first = [], 0
        for group in plan.groups:
            group_q = q[first : first + group.num_seqs]
            outs.append(self._decode_group(group_q, view, group))
            first += group.num_seqs
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode_group(self, q: torch.Tensor, view: _GatherView, group: DecodeGroup) -> torch.Tensor:
        # The G query heads sharing a KV head act as G queries of that head:
        # q [n, H, D] -> [n, KVH, G, D], so K/V are never repeated.
        num_seqs, num_heads, head_dim = q.shape
        kv_heads = view.rows.shape[2]
        kv = self._gather(view, group.gather_rows, q.dtype)
        kv = kv.view(num_seqs, 2, group.width_tokens, kv_heads, head_dim)
        if group.context_len is not None:
            kv = kv[:, :, : group.context_len]
        keys, values = kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)  # [n, KVH, len, D]
        grouped_q = q.reshape(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
        if num_seqs == 1 and group.key_mask is None and q.dtype == torch.float32:
            out = _attend_unmasked(grouped_q[0], keys[0], values[0])
        else:
            out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=group.key_mask)
        return out.reshape(num_seqs, num_heads * head_dim)

    def _prefill(
        self,
        q: torch.Tensor,  # [n, H, D], this chunk's rows
        k: torch.Tensor,  # [n, KVH, D]
        v: torch.Tensor,
        view: _GatherView,
        chunk: PrefillPlan,
    ) -> torch.Tensor:
        # The chunk's own K/V as the pool holds them, so an int8 pool reads alike here and in
        # the native kernels.
        k, v = view.kv_format.as_stored(k), view.kv_format.as_stored(v)
        prefix = None
        if chunk.gather_rows is not None:
            kv_heads, head_dim = k.shape[1], k.shape[2]
            kv = self._gather(view, chunk.gather_rows, q.dtype)
            # [2 * blocks, bs, KVH, D] -> [2, KVH, prefix_len, D]
            kv = kv.view(2, -1, kv_heads, head_dim)[:, : chunk.prefix_len].transpose(1, 2)
            prefix = (kv[0], kv[1])
        if chunk.tree_mask is not None:
            return attend_tree(q, k, v, prefix, chunk.tree_mask)  # [n, H * D]
        if prefix is None:
            return attend_fresh(q, k, v)
        return attend_after_prefix(q, k, v, *prefix)


@dataclass(slots=True, frozen=True)
class _GatherView:
    """The pool as gather rows ``[num_blocks * L * 2, block_size, KVH, row]`` (see the module
    docstring), read for one layer, and the format of its rows."""

    rows: torch.Tensor
    layer_idx: int
    kv_format: KVFormat

    @property
    def row_offset(self) -> int:
        """What layer ``layer_idx`` adds to a layer-0 gather row."""
        return 2 * self.layer_idx


def _attend_unmasked(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention of a few queries over one sequence: ``q [KVH, G, D]``, K/V ``[KVH, len, D]``.

    Two batched GEMMs read the strided K/V views in place; for a handful of fp32 queries this
    measured ~2x faster than SDPA's CPU kernel (in bf16 it was slower, so SDPA is kept).
    """
    scores = torch.bmm(q, keys.transpose(1, 2))  # [KVH, G, len]
    probs = torch.softmax(scores * q.shape[-1] ** -0.5, dim=-1)
    return torch.bmm(probs, values)  # [KVH, G, D]
