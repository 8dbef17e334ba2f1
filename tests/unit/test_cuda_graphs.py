"""The decode-graph layer (engine/cuda_graphs/runner.py) on the CPU, with a fake graph.

``EagerFakeGraph`` stands in for ``torch.cuda.CUDAGraph``, which cannot run here: its
"replay" calls the captured function again and writes the captured output tensor, as a
replay does. So these tests check everything around the capture (buckets, pad rows in the
scratch block, the static buffers refreshed in place, the real rows sliced back out)
against eager steps of the same model; that a real capture replays the same kernels is
checked on a GPU by ``python -m pdserve.bench.gpu_check``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pdserve.engine.attention import get_backend
from pdserve.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    StepLayout,
    step_metadata,
    write_kv,
)
from pdserve.engine.cuda_graphs import SCRATCH_BLOCKS, DecodeGraphs, graph_capture_sizes
from pdserve.engine.model.llama import LlamaModel
from pdserve.engine.model.loader import model_from_hf_state_dict
from pdserve.engine.runner import ModelRunner, allocate_kv_cache
from pdserve.engine.scheduler.plan import BatchPlan, ScheduledChunk
from tests.triton_interpreter import kernels_for

BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 4, 64, 64
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


class EagerFakeGraph:
    """A fake CUDA graph: replay re-runs the captured function into the captured output."""

    def __init__(self) -> None:
        self.forward: Callable[[], torch.Tensor] | None = None
        self.output: torch.Tensor | None = None
        self.replays = 0

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.forward, self.output = forward, forward()
        return self.output

    def replay(self) -> None:
        assert self.forward is not None and self.output is not None, "replay before capture"
        self.output.copy_(self.forward())
        self.replays += 1


@dataclass(slots=True, frozen=True)
class _DecodeTensors:
    block_tables: torch.Tensor  # [B, W] int64
    context_lens: torch.Tensor  # [B] int64


class TensorDecodeBackend(AttentionBackend):
    """A test backend whose decode steps read every per-step value from tensors shaped by
    the batch and the table width only (what a graph needs); other steps go to the CPU
    backend. Plain masked attention over whole block tables: slow, obviously right."""

    name = "test-tensor-decode"

    def __init__(self) -> None:
        self._cpu = get_backend("cpu-grouped")

    def build_metadata(
        self, layout: StepLayout, block_size: int, num_layers: int, device: torch.device
    ) -> AttentionMetadata:
        q_lens = {e - s for s, e in zip(layout.start_positions, layout.context_lens, strict=True)}
        widths = {len(t) for t in layout.block_tables}
        if q_lens != {1} or len(widths) != 1:
            return self._cpu.build_metadata(layout, block_size, num_layers, device)
        data = _DecodeTensors(
            torch.tensor(layout.block_tables, dtype=torch.int64, device=device),
            torch.tensor(layout.context_lens, dtype=torch.int64, device=device),
        )
        return step_metadata(layout, block_size, num_layers, device, self, data)

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        data = attn.backend_data
        assert isinstance(data, _DecodeTensors)
        write_kv(kv_cache, layer_idx, attn.write_rows, k, v)
        rows, heads, head_dim = q.shape
        kv_heads = kv_cache.shape[4]
        # [B, W, block_size, KVH, D] -> [B, S, H, D]
        keys = kv_cache[data.block_tables, layer_idx, 0].reshape(rows, -1, kv_heads, head_dim)
        values = kv_cache[data.block_tables, layer_idx, 1].reshape(rows, -1, kv_heads, head_dim)
        keys = keys.repeat_interleave(heads // kv_heads, dim=2)
        values = values.repeat_interleave(heads // kv_heads, dim=2)
        scores = torch.einsum("bhd,bshd->bhs", q, keys) * head_dim**-0.5
        visible = torch.arange(keys.shape[1]) < data.context_lens[:, None]  # [B, S]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out = torch.einsum("bhs,bshd->bhd", scores.softmax(dim=-1), values)
        return out.reshape(rows, heads * head_dim)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    torch.manual_seed(0)
    config = LlamaConfig(**TINY)
    hf = LlamaForCausalLM(config).eval()
    return model_from_hf_state_dict(config.to_dict(), hf.state_dict(), "tiny-random")


def _runner(
    model: LlamaModel, graphs: DecodeGraphs | None, backend: AttentionBackend | None = None
) -> ModelRunner:
    extra = SCRATCH_BLOCKS if graphs is not None else 0
    pool = allocate_kv_cache(model.config, NUM_BLOCKS + extra, BLOCK_SIZE)
    backend = backend or TensorDecodeBackend()  # type: ignore[assignment]
    return ModelRunner(model.config, model, pool, BLOCK_SIZE, "cpu", backend, graphs)


def _steps(runner: ModelRunner, prompts: list[list[int]], decode_steps: int) -> list[torch.Tensor]:
    """Prefill every prompt in one step, then greedy decode steps, dropping one sequence
    every other step so the batch moves between buckets. Returns each step's logits."""
    per_seq = NUM_BLOCKS // len(prompts)
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    chunks = [ScheduledChunk(str(i), tuple(p), 0, tables[i], True) for i, p in enumerate(prompts)]
    seqs = [list(p) for p in prompts]
    out = []
    for step in range(decode_steps + 1):
        logits = runner.execute(BatchPlan(chunks=tuple(chunks)))
        out.append(logits)
        live = [int(c.seq_id) for c in chunks]
        for i, token in zip(live, logits.argmax(dim=-1).tolist(), strict=True):
            seqs[i].append(token)
        if step % 2 and len(live) > 1:
            live.pop()
        chunks = [
            ScheduledChunk(str(i), (seqs[i][-1],), len(seqs[i]) - 1, tables[i], True) for i in live
        ]
    return out


def test_graph_replays_match_eager_steps(model: LlamaModel) -> None:
    prompts = [[(7 * i + j) % 256 for j in range(3 + 2 * i)] for i in range(6)]
    graph_count: list[EagerFakeGraph] = []

    def factory() -> EagerFakeGraph:
        graph_count.append(EagerFakeGraph())
        return graph_count[-1]

    graphs = DecodeGraphs(graph_capture_sizes(8), factory, MAX_MODEL_LEN)
    graphed = _steps(_runner(model, graphs), prompts, decode_steps=8)
    eager = _steps(_runner(model, None), prompts, decode_steps=8)
    assert len(graph_count) == len(graph_capture_sizes(8)) == 4  # buckets 1, 2, 4, 8
    assert graphs.replays == 8, "every decode step (not the prefill) replays a graph"
    assert [t.shape for t in graphed] == [t.shape for t in eager]
    for got, want in zip(graphed, eager, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cuda_triton_decode_replays_match_eager(model: LlamaModel) -> None:
    """The real GPU backend, its kernels under Triton's interpreter: its decode metadata
    refreshes in place (shapes fixed by the bucket and the table width), and replays give
    the eager steps' logits."""
    prompts = [[(5 * i + j) % 256 for j in range(2 + 3 * i)] for i in range(3)]
    with kernels_for("interpreter", "pdserve.engine.attention.triton") as (modules, _device):
        make_backend = modules[0].make_triton_backend
        graphs = DecodeGraphs((1, 2, 4), EagerFakeGraph, MAX_MODEL_LEN)
        graphed = _steps(_runner(model, graphs, make_backend()), prompts, decode_steps=3)
        eager = _steps(_runner(model, None, make_backend()), prompts, decode_steps=3)
    assert graphs.replays == 3
    for got, want in zip(graphed, eager, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_scratch_block_takes_the_pad_rows(model: LlamaModel) -> None:
    graphs = DecodeGraphs((4,), EagerFakeGraph, MAX_MODEL_LEN)
    runner = _runner(model, graphs)
    runner.kv_cache.zero_()
    chunk = ScheduledChunk("0", (5,), 0, (3,), True)
    runner.execute(BatchPlan(chunks=(chunk,)))  # one real row, three pad rows
    written = runner.kv_cache.flatten(1).abs().sum(dim=1).nonzero().flatten().tolist()
    assert written == [3, NUM_BLOCKS], "only the real row's block and the scratch block"


def test_backend_with_step_sized_tensors_runs_eagerly(model: LlamaModel) -> None:
    """The CPU backend's decode tensors change shape with the step: never replayed."""
    graphs = DecodeGraphs((2,), EagerFakeGraph, MAX_MODEL_LEN)
    pool = allocate_kv_cache(model.config, NUM_BLOCKS + SCRATCH_BLOCKS, BLOCK_SIZE)
    backend = get_backend("cpu-grouped")
    runner = ModelRunner(model.config, model, pool, BLOCK_SIZE, "cpu", backend, graphs)
    two = (
        ScheduledChunk("0", (5,), 0, (0,), True),
        ScheduledChunk("1", (6,), 9, (1, 2, 3), True),
    )
    assert runner.execute(BatchPlan(chunks=two)).shape == (2, TINY["vocab_size"])
    assert graphs.replays == 0


def test_steps_without_a_bucket_or_with_prefill_run_eagerly(model: LlamaModel) -> None:
    graphs = DecodeGraphs((1,), EagerFakeGraph, MAX_MODEL_LEN)
    runner = _runner(model, graphs)
    two = tuple(ScheduledChunk(str(i), (5,), 0, (i,), True) for i in range(2))
    prefill = (ScheduledChunk("9", (1, 2, 3), 0, (9,), True),)
    assert runner.execute(BatchPlan(chunks=two)).shape == (2, TINY["vocab_size"])
    assert runner.execute(BatchPlan(chunks=prefill)).shape == (1, TINY["vocab_size"])
    assert graphs.replays == 0
