"""This machine's floor for the workload: a roofline over an ideal continuous-batching schedule.

Each step costs at least ``max(bytes moved / memory bandwidth, FLOPs / matmul throughput)``:
bytes are the weights (read once per step) plus the KV cache read and written; FLOPs are the
linear layers, the LM head for the rows that sample, and attention (QK^T and PV). Bandwidth
and matmul throughput are measured here at the benchmark dtype, before and after the run
being judged, each taken at its best (``best_reading``). The schedule is the best a
continuous batcher could do: every request admitted at t=0 (up to ``max_seqs``), decode
tokens first, prompts chunked into the rest of the token budget, no KV limit, no per-step
overhead. No real system reaches it; it says how far from the hardware we are.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class ModelShape:
    """The sizes that cost bytes and FLOPs. Defaults: SmolLM2-135M (Llama, tied embeddings)."""

    num_layers: int = 30
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    vocab_size: int = 49152

    @property
    def layer_params(self) -> int:
        """Linear weights of one decoder layer (q, k, v, o, gate, up, down)."""
        q_and_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return q_and_o + k_and_v + mlp

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * bytes_per_element


@dataclass(slots=True, frozen=True)
class StepShape:
    """One engine step, as far as cost is concerned."""

    num_tokens: int  # tokens run through the model this step
    attended_context_tokens: int  # sum over those tokens of the positions each attends to
    num_sampled: int = 0  # rows that go through the LM head
    kv_read_tokens: int = 0  # sum over sequences of cached positions read


@dataclass(slots=True, frozen=True)
class Roofline:
    memory_bandwidth_gb_s: float
    matmul_gflop_s: float


def measure_memory_bandwidth_gb_s(size_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Best-of-``repeats`` large tensor copy; counts bytes read plus bytes written."""
    src = torch.ones(size_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best_s = _best_time_s(lambda: dst.copy_(src), repeats)
    return 2 * size_bytes / best_s / 1e9


def measure_matmul_gflop_s(
    dtype: torch.dtype,
    token_counts: Sequence[int] = (64, 256, 1024),
    in_features: int = 576,
    out_features: int = 1536,
    repeats: int = 5,
) -> float:
    """Best throughput of ``[T, in] @ [in, out]`` (the MLP up-projection shape) over T."""
    weight = torch.randn(in_features, out_features).to(dtype)  # [in, out]
    best = 0.0
    for num_tokens in token_counts:
        x = torch.randn(num_tokens, in_features).to(dtype)  # [T, in]
        best_s = _best_time_s(functools.partial(torch.mm, x, weight), repeats)
        best = max(best, 2 * num_tokens * in_features * out_features / best_s / 1e9)
    return best


def measure_roofline(dtype: torch.dtype) -> Roofline:
    return Roofline(measure_memory_bandwidth_gb_s(), measure_matmul_gflop_s(dtype))


def best_reading(readings: Sequence[Roofline]) -> Roofline:
    """Each quantity at its best over ``readings`` (say, before and after a long run).

    Why: this machine's bandwidth and matmul rate drift by 20% and more within minutes (other
    tenants), so one reading taken before a minute-long run can catch it at a slow moment and
    flatter the run. Every reading is already a best of repeats; more readings spread over the
    run only make the floor as demanding as the machine showed it can be.
    """
    assert readings, "no roofline readings"
    return Roofline(
        max(r.memory_bandwidth_gb_s for r in readings), max(r.matmul_gflop_s for r in readings)
    )


def _best_time_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and kernel selection are not the steady state
    best_s = float("inf")
    for _ in range(repeats):
        start_s = time.perf_counter()
        fn()
        best_s = min(best_s, time.perf_counter() - start_s)
    return best_s


def step_costs_s(
    step: StepShape, model: ModelShape, roof: Roofline, bytes_per_element: int
) -> tuple[float, float]:
    """(bytes / bandwidth, FLOPs / matmul throughput) of one step, in seconds."""
    weight_params = model.num_layers * model.layer_params
    if step.num_sampled:
        weight_params += model.lm_head_params
    kv_tokens = step.kv_read_tokens + step.num_tokens  # read the cache, write the new tokens
    bytes_moved = weight_params * bytes_per_element
    bytes_moved += kv_tokens * model.kv_bytes_per_token(bytes_per_element)
    linear_flops = 2 * step.num_tokens * model.num_layers * model.layer_params
    lm_head_flops = 2 * step.num_sampled * model.lm_head_params
    # QK^T and PV: 2 FLOPs per multiply-add each, per head, per layer, per attended position.
    attention_flops = (
        4 * step.attended_context_tokens * model.num_heads * model.head_dim * model.num_layers
    )
    flops = linear_flops + lm_head_flops + attention_flops
    return bytes_moved / (roof.memory_bandwidth_gb_s * 1e9), flops / (roof.matmul_gflop_s * 1e9)


def step_floor_s(
    step: StepShape, model: ModelShape, roof: Roofline, bytes_per_element: int
) -> float:
    """max(bytes / bandwidth, FLOPs / matmul throughput) for one step."""
    return max(step_costs_s(step, model, roof, bytes_per_element))


def floor_s(
    steps: Sequence[StepShape], model: ModelShape, roof: Roofline, bytes_per_element: int
) -> float:
    return sum(step_floor_s(step, model, roof, bytes_per_element) for step in steps)


@dataclass(slots=True)
class _SimSeq:
    prompt_tokens: int
    output_tokens: int
    prefilled: int = 0
    generated: int = 0


def simulate_schedule(
    lengths: Sequence[tuple[int, int]], token_budget: int = 2048, max_seqs: int = 64
) -> list[StepShape]:
    """Ideal continuous batching of ``lengths`` = [(prompt_tokens, output_tokens)], all at t=0.

    A sequence samples its first output token in the step that finishes its prompt, then one
    token per decode step. Decode tokens are scheduled before prefill chunks.
    """
    if token_budget < 1 or max_seqs < 1:
        raise ValueError(
            f"need token_budget >= 1 and max_seqs >= 1, got {token_budget}, {max_seqs}"
        )
    waiting = [_SimSeq(p, o) for p, o in lengths]
    waiting.reverse()  # pop() from the end takes them in workload order
    running: list[_SimSeq] = []
    steps = []
    while waiting or running:
        while waiting and len(running) < max_seqs:
            running.append(waiting.pop())
        steps.append(_simulate_step(running, token_budget))
        running = [s for s in running if s.generated < s.output_tokens]
    return steps


def _simulate_step(running: list[_SimSeq], token_budget: int) -> StepShape:
    tally = _StepTally(budget=token_budget)
    for seq in [s for s in running if s.prefilled == s.prompt_tokens]:
        if tally.budget == 0:
            break
        cached = seq.prompt_tokens + seq.generated - 1  # positions before the fed token
        tally.add(tokens=1, attended=cached + 1, kv_read=cached, sampled=1)
        seq.generated += 1
    for seq in [s for s in running if s.prefilled < s.prompt_tokens]:
        if tally.budget == 0:
            break
        chunk = min(tally.budget, seq.prompt_tokens - seq.prefilled)
        # token j of the chunk (0-based) attends to prefilled + j + 1 positions
        attended = chunk * seq.prefilled + chunk * (chunk + 1) // 2
        seq.prefilled += chunk
        done = seq.prefilled == seq.prompt_tokens
        tally.add(tokens=chunk, attended=attended, kv_read=seq.prefilled - chunk, sampled=int(done))
        seq.generated = 1 if done else 0
    return StepShape(tally.num_tokens, tally.attended, tally.sampled, tally.kv_read)


@dataclass(slots=True)
class _StepTally:
    budget: int
    num_tokens: int = 0
    attended: int = 0
    sampled: int = 0
    kv_read: int = 0

    def add(self, tokens: int, attended: int, kv_read: int, sampled: int) -> None:
        self.budget -= tokens
        self.num_tokens += tokens
        self.attended += attended
        self.kv_read += kv_read
        self.sampled += sampled
