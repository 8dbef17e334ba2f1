"""The model runner: turns a :class:`BatchPlan` into logits. It decides no policy.

One step = copy-on-write block copies, then one forward over the flat batch of every
scheduled chunk, then logits for the last position of each chunk with ``sample=True``.

KV pool layout (project-wide contract, see ``engine/attention/base.py``)::

    kv_cache: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, row]

Block-major, so one block's KV for all layers is one contiguous byte range (one NIXL
descriptor per block). A row is ``head_dim`` values in the model's dtype, or in an int8 pool
``head_dim`` int8 values and their scale (``engine/attention/kv_format.py``).
"""

from __future__ import annotations

import torch

from pdserve.engine.attention import AttentionBackend, get_backend, layout_chunks, token_positions
from pdserve.engine.attention.kv_format import kv_format_for, kv_format_of
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.host_memory import advise_huge_pages, keep_freed_memory
from pdserve.engine.kv_cache import kv_block_bytes
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.llama import LlamaModel
from pdserve.engine.model.packed_linear import can_pack
from pdserve.engine.scheduler.plan import BatchPlan


def kv_cache_shape(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32
) -> tuple[int, int, int, int, int, int]:
    """The shape of a pool of ``dtype`` (int8: rows of int8 values and their scale)."""
    row = kv_format_for(dtype).row_elems(config.head_dim)
    return (num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, row)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block (all layers, K and V) of a pool of ``dtype``: the unit of
    allocation and of transfer."""
    kv_format = kv_format_for(dtype)
    return kv_block_bytes(
        config.num_layers,
        block_size,
        config.num_kv_heads,
        config.head_dim,
        kv_format.pool_dtype.itemsize,
        kv_format.scale_bytes,
    )


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A zeroed pool of ``num_blocks`` blocks of ``dtype`` (int8: int8 rows with a scale
    each; zeros keep padded reads finite), on huge pages where the OS grants them (see
    ``engine/host_memory.py``)."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
    shape = kv_cache_shape(config, num_blocks, block_size, dtype)
    pool = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(pool)  # before the first write: pages faulted in small stay small
    return pool.zero_()


class ModelRunner:
    """Executes step plans on one model and one KV pool."""

    def __init__(
        self,
        model_config: ModelConfig,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        block_size: int,
        device: torch.device | str = "cpu",
        attention_backend: AttentionBackend | None = None,
        decode_graphs: DecodeGraphs | None = None,
    ) -> None:
        """``decode_graphs``: captured here, then replayed for steps of decode tokens only;
        the pool's last ``SCRATCH_BLOCKS`` blocks are theirs (``engine/cuda_graphs/``)."""
        model_dtype = model.embed_tokens.weight.dtype
        if kv_cache.dtype not in (model_dtype, torch.int8):
            raise ValueError(
                f"kv_cache dtype {kv_cache.dtype} is neither the model's {model_dtype} nor "
                "int8; allocate the pool with allocate_kv_cache"
            )
        self.kv_format = kv_format_of(kv_cache)
        expected = kv_cache_shape(model_config, kv_cache.shape[0], block_size, kv_cache.dtype)
        if tuple(kv_cache.shape) != expected:
            raise ValueError(
                f"kv_cache shape {tuple(kv_cache.shape)} does not match the model, block_size "
                f"{block_size} and the {self.kv_format.name} format: expected {expected}"
            )
        self.config = model_config
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = torch.device(device)
        self.attention = attention_backend or get_backend("auto", self.device, block_size)
        if self.device.type == "cpu":
            keep_freed_memory()  # steps reuse the pages of the last one's activations
        if can_pack(self.device, model_dtype):
            model.pack_linears()  # in place and idempotent: engines may share one model
        self.decode_graphs = decode_graphs
        if decode_graphs is not None:
            decode_graphs.capture(model, self.attention, kv_cache, block_size)

    @property
    def num_blocks(self) -> int:
        return int(self.kv_cache.shape[0])

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> torch.Tensor:
        """Run one step; returns fp32 logits ``[num_sampled, vocab]`` in plan order (a verify
        chunk gives one row per token, root first)."""
        if plan.block_copies:
            self._copy_blocks(plan.block_copies)
        if not plan.chunks:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        if self.decode_graphs is not None and _decode_only(plan):
            logits = self.decode_graphs.run(plan.chunks)
            if logits is not None:
                return logits
        layout = layout_chunks(plan.chunks, self.block_size)
        token_ids = [t for chunk in plan.chunks for t in chunk.token_ids]
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        position_list = token_positions(layout)
        positions = torch.tensor(position_list, dtype=torch.int64, device=self.device)
        attn = self.attention.build_metadata(
            layout, self.block_size, self.config.num_layers, self.device
        )
        # [T, hidden]; the positions' bound is known here, so the model need not read it back
        hidden = self.model(
            input_ids, positions, attn, self.kv_cache, max_position=max(position_list)
        )
        ends = layout.query_start_loc[1:]
        sample_rows = [
            row
            for end, chunk in zip(ends, plan.chunks, strict=True)
            for row in range(end - chunk.num_sampled_rows, end)
        ]
        if len(sample_rows) != len(token_ids):  # all-decode steps sample every row: no gather
            hidden = hidden[torch.tensor(sample_rows, dtype=torch.int64, device=self.device)]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def move_slots(self, moves: list[tuple[int, int]]) -> None:
        """Copy single token slots ``src -> dst`` (every layer, K and V, whole rows: an int8
        pool's scales with them), in order: an accepted speculative token's K/V moves from
        its tree slot to its position's slot."""
        if not moves:
            return
        bs = self.block_size
        src = torch.tensor([s for s, _ in moves], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in moves], dtype=torch.int64, device=self.device)
        assert int(max(src.max(), dst.max())) < self.num_blocks * bs, (
            f"slot move {moves} outside the pool of {self.num_blocks} blocks"
        )
        # The gather on the right reads every source before any destination is written.
        pool = self.kv_cache
        pool[dst // bs, :, :, dst % bs] = pool[src // bs, :, :, src % bs]

    def _copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy whole blocks (every layer, K and V) ``src -> dst``, all reads before writes."""
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=self.device)
        assert int(max(src.max(), dst.max())) < self.num_blocks, (
            f"block copy {copies} outside the pool of {self.num_blocks} blocks"
        )
        self.kv_cache.index_copy_(0, dst, self.kv_cache.index_select(0, src))


def _decode_only(plan: BatchPlan) -> bool:
    """Every chunk is one sampled decode token (no prefill, no verify tree)."""
    return all(c.num_tokens == 1 and c.sample and c.tree is None for c in plan.chunks)
