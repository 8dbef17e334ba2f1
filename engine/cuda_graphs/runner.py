"""Captured decode steps: one graph per batch bucket (``buckets.py``), replayed for steps of
decode tokens only; prefill, mixed and verify steps run eagerly.

A graph replays the kernels it recorded on the buffers it recorded. So each bucket owns
static inputs (token ids, positions, the attention metadata's tensors); a step copies its
padded values into them and replays. The metadata is captured for a full-width block
table and the longest context, so any launch size the backend derived from Python values
at capture bounds every later step; at replay only tensor contents change. That works for
a backend whose decode reads its per-step values from its metadata's tensors, with shapes
that depend only on the batch and the table width. A step whose fresh metadata has other
tensor shapes (a backend that gathers a step-sized K/V) runs eagerly instead: never a
replay on stale buffers. ``python -m pdserve.bench.gpu_check`` checks graph output against
eager output on a GPU.

The graph itself is behind :class:`DecodeGraph`, so everything around the capture (padding,
static buffers, refreshing them, slicing the real rows back out) also runs on the CPU with
a fake that calls the captured function again (``tests/unit/test_cuda_graphs.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata, StepLayout
from pdserve.engine.cuda_graphs.buckets import (
    DecodeBatch,
    bucket_for,
    decode_batch,
    pad_decode_batch,
)
from pdserve.engine.model.llama import LlamaModel
from pdserve.engine.scheduler.plan import ScheduledChunk

log = logging.getLogger(__name__)

# Blocks the pool holds beyond the KV cache manager's: pad rows write there (buckets.py).
SCRATCH_BLOCKS = 1


class DecodeGraph(Protocol):
    """A recorded step: ``capture(forward)`` runs and records it, returning its output
    tensor; ``replay()`` runs it again, writing that same tensor."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


GraphFactory = Callable[[], DecodeGraph]


class CudaDecodeGraph:
    """A :class:`DecodeGraph` on ``torch.cuda.CUDAGraph``; graphs made by one factory share
    a memory pool (only one replays at a time)."""

    def __init__(self, pool: Any) -> None:  # a torch.cuda.graph_pool_handle()
        self._pool = pool
        self._graph = torch.cuda.CUDAGraph()

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        # A warm-up run on a side stream first: lazy initialisation (cuBLAS handles and
        # workspaces, autotuned kernels) must not happen inside the capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self._graph, pool=self._pool):
            output = forward()
        return output

    def replay(self) -> None:
        self._graph.replay()


def cuda_graph_factory() -> GraphFactory:
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaDecodeGraph(pool)


@dataclass(slots=True)
class _StaticStep:
    """One bucket's recorded step and the buffers it reads and writes."""

    input_ids: torch.Tensor  # [bucket] int64
    positions: torch.Tensor  # [bucket] int64
    recorded: AttentionMetadata  # the metadata whose tensors the graph reads
    current: AttentionMetadata  # this step's metadata (what a re-run in Python reads)
    graph: DecodeGraph
    logits: torch.Tensor | None = None  # [bucket, vocab] fp32, written by each replay


class DecodeGraphs:
    """Graphs for decode steps of up to ``max(capture_sizes)`` sequences."""

    def __init__(
        self, capture_sizes: tuple[int, ...], graph_factory: GraphFactory, max_model_len: int
    ) -> None:
        self.capture_sizes = capture_sizes
        self._graph_factory = graph_factory
        self._max_model_len = max_model_len
        self._steps: dict[int, _StaticStep] = {}
        self._warned_shapes = False
        self.replays = 0  # steps served by a graph (for tests and step profiles)

    def capture(
        self,
        model: LlamaModel,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,  # its last SCRATCH_BLOCKS blocks are the pad rows' scratch
        block_size: int,
    ) -> None:
        """Record one step per bucket, the largest first (smaller graphs then fit in the
        memory the largest one's pool already holds)."""
        self._model, self._backend, self._kv_cache = model, backend, kv_cache
        self._block_size = block_size
        self._scratch_block = kv_cache.shape[0] - SCRATCH_BLOCKS
        self._table_width = -(-self._max_model_len // block_size)
        for size in sorted(self.capture_sizes, reverse=True):
            self._steps[size] = self._record(size)
        log.info("captured decode graphs for batch sizes %s", self.capture_sizes)

    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor | None:
        """fp32 logits ``[len(chunks), vocab]`` of a decode step run by a graph, or None
        when no graph takes it (too many rows, or its metadata has other shapes)."""
        bucket = bucket_for(len(chunks), self.capture_sizes)
        if bucket is None or max(c.start_pos for c in chunks) >= self._max_model_len:
            return None
        batch = decode_batch(
            [c.token_ids[0] for c in chunks],
            [c.start_pos for c in chunks],
            [c.block_table for c in chunks],
            self._block_size,
            self._table_width,
            self._scratch_block,
        )
        step = self._steps[bucket]
        padded = pad_decode_batch(batch, bucket, self._scratch_block)
        fresh = self._metadata(padded)
        if not _copy_tensors(fresh, step.recorded):
            self._warn_shapes(bucket)
            return None
        step.current = fresh
        step.input_ids.copy_(torch.tensor(padded.token_ids, dtype=torch.int64))
        step.positions.copy_(torch.tensor(padded.positions, dtype=torch.int64))
        step.graph.replay()
        self.replays += 1
        assert step.logits is not None, f"bucket {bucket} replayed before it was captured"
        # A copy: the next replay overwrites the static logits.
        return step.logits[: len(batch)].clone()

    def _record(self, size: int) -> _StaticStep:
        device = self._kv_cache.device
        longest = self._max_model_len - 1
        pad_rows = DecodeBatch(
            token_ids=(0,) * size,
            positions=(longest,) * size,
            block_tables=((self._scratch_block,) * self._table_width,) * size,
        )
        recorded = self._metadata(pad_rows)
        step = _StaticStep(
            input_ids=torch.zeros(size, dtype=torch.int64, device=device),
            positions=torch.zeros(size, dtype=torch.int64, device=device),
            recorded=recorded,
            current=recorded,
            graph=self._graph_factory(),
        )
        step.logits = step.graph.capture(lambda: self._forward(step))
        return step

    def _forward(self, step: _StaticStep) -> torch.Tensor:
        # The capture's positions are the longest context's; a replayed step's are checked
        # against that in run(), on the host.
        longest = self._max_model_len - 1
        hidden = self._model(
            step.input_ids, step.positions, step.current, self._kv_cache, max_position=longest
        )
        return self._model.compute_logits(hidden)

    def _metadata(self, batch: DecodeBatch) -> AttentionMetadata:
        layout = StepLayout(
            query_start_loc=tuple(range(len(batch) + 1)),
            start_positions=batch.positions,
            context_lens=batch.context_lens,
            block_tables=batch.block_tables,
        )
        num_layers = self._model.config.num_layers
        return self._backend.build_metadata(
            layout, self._block_size, num_layers, self._kv_cache.device
        )

    def _warn_shapes(self, bucket: int) -> None:
        if not self._warned_shapes:
            log.warning(
                "attention backend %s builds decode metadata whose tensor shapes change "
                "from step to step (bucket %d): its decode steps run eagerly",
                self._backend.name,
                bucket,
            )
            self._warned_shapes = True


def _copy_tensors(src: AttentionMetadata, dst: AttentionMetadata) -> bool:
    """Copy every tensor of ``src`` into its place in ``dst``; False, copying nothing, when
    their tensors differ in number, shape, dtype or device."""
    sources, targets = _metadata_tensors(src), _metadata_tensors(dst)
    if len(sources) != len(targets) or any(
        s.shape != d.shape or s.dtype != d.dtype or s.device != d.device
        for s, d in zip(sources, targets, strict=True)
    ):
        return False
    for s, d in zip(sources, targets, strict=True):
        d.copy_(s)
    return True


def _metadata_tensors(attn: AttentionMetadata) -> list[torch.Tensor]:
    return [attn.slot_mapping, attn.write_rows, *_tensors(attn.backend_data)]


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors inside ``value``, in a fixed order (dataclasses, tuples, lists walked)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return [t for f in fields for t in _tensors(getattr(value, f.name))]
    if isinstance(value, tuple | list):
        return [t for item in value for t in _tensors(item)]
    return []
