"""The cost model: one CPU worker of this machine, calibrated from docs/benchmarks.md.

Every default below names the measured figure it comes from (docs/benchmarks.md, "Autoscaling at
scale", has the derivations). A worker is what the cluster benchmarks ran: one core, bf16, one
torch thread, 1,024 KV blocks of 16 tokens. A GPU cluster's figures would scale every rate.

* prefill: ``n / prefill_tokens_per_s * (1 + n / prefill_attention_tokens)`` seconds for an
  ``n``-token prompt, FCFS (the second factor is attention growing with the prompt);
* decode: continuous batching; one step takes ``decode_base_s + Σ_i (decode_per_seq_s +
  decode_per_context_token_s * context_i)``; a request's inter-token latency is the step time;
* KV transfer: ``prompt tokens * kv_bytes_per_token / kv_link_bytes_per_s``;
* a new worker serves after a start-up time drawn in ``[startup_min_s, startup_max_s]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.cluster.autoscale import CapacityProfile, DecodePoint, max_batch_within_itl
from pdserve.router.policies import CostModel as RouterCostModel

# Batch sizes a profiling run measures (those the KV pool can hold).
PROFILE_BATCHES = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64)


@dataclass(frozen=True, slots=True)
class Slo:
    """A request is good when TTFT <= ttft_s and TPOT <= tpot_s (DistServe's definition)."""

    ttft_s: float = 1.5
    tpot_s: float = 0.150


@dataclass(frozen=True, slots=True)
class CostModel:
    """Per-worker costs; see the module docstring and docs/benchmarks.md."""

    prefill_tokens_per_s: float = 1500.0
    prefill_attention_tokens: float = 4100.0
    decode_base_s: float = 0.044
    decode_per_seq_s: float = 0.00329
    decode_per_context_token_s: float = 1.44e-6
    kv_bytes_per_token: int = 23_040
    kv_link_bytes_per_s: float = 3.6e9
    rpc_s: float = 0.0045
    block_size: int = 16
    kv_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    startup_min_s: float = 17.8
    startup_max_s: float = 19.2

    @property
    def startup_s(self) -> float:
        """Expected start-up time (what a profile records)."""
        return (self.startup_min_s + self.startup_max_s) / 2

    def prefill_s(self, tokens: float, prompt_tokens: float | None = None) -> float:
        """Seconds to prefill ``tokens`` tokens of a ``prompt_tokens``-token prompt."""
        n = tokens if prompt_tokens is None else prompt_tokens
        return tokens / self.prefill_tokens_per_s * (1.0 + n / self.prefill_attention_tokens)

    def decode_step_s(self, batch: int, context_sum: float) -> float:
        """One decode step with ``batch`` sequences holding ``context_sum`` tokens in all."""
        if batch <= 0:
            return 0.0
        return (
            self.decode_base_s
            + batch * self.decode_per_seq_s
            + context_sum * self.decode_per_context_token_s
        )

    def itl_s(self, batch: float, context: float) -> float:
        """Inter-token latency of ``batch`` sequences of ``context`` tokens each."""
        return self.decode_base_s + batch * (
            self.decode_per_seq_s + context * self.decode_per_context_token_s
        )

    def transfer_s(self, prompt_tokens: float) -> float:
        return prompt_tokens * self.kv_bytes_per_token / self.kv_link_bytes_per_s

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def router_cost(self) -> RouterCostModel:
        """The routing policies' TTFT model, set to these figures."""
        return RouterCostModel(
            prefill_s_per_token=1.0 / self.prefill_rate_at(512),
            kv_bytes_per_token=self.kv_bytes_per_token,
            link_bytes_per_s=self.kv_link_bytes_per_s,
        )

    def prefill_rate_at(self, prompt_tokens: float) -> float:
        """Prompt tokens/s of one prefill worker on prompts of this length."""
        return prompt_tokens / self.prefill_s(prompt_tokens)

    def kv_batch_limit(self, input_tokens: float, output_tokens: float) -> int:
        """Sequences one worker's KV pool holds (each reserves prompt + output blocks)."""
        per_seq = self.blocks(math.ceil(input_tokens + output_tokens))
        return max(1, min(self.max_num_seqs, self.kv_blocks // per_seq))

    def decode_batch_at_slo(self, input_tokens: float, output_tokens: float, itl_s: float) -> int:
        """Largest batch that fits the KV pool with an ITL within ``itl_s`` (at least 1)."""
        context = input_tokens + output_tokens / 2
        limit = self.kv_batch_limit(input_tokens, output_tokens)
        best = 1
        for b in range(1, limit + 1):
            if self.itl_s(b, context) <= itl_s:
                best = b
        return best

    def decode_rate_at_slo(self, input_tokens: float, output_tokens: float, itl_s: float) -> float:
        """Output tokens/s of one decode worker at :meth:`decode_batch_at_slo`."""
        b = self.decode_batch_at_slo(input_tokens, output_tokens, itl_s)
        return b / self.itl_s(b, input_tokens + output_tokens / 2)


def capacity_profile(
    cost: CostModel, input_tokens: float, output_tokens: float, slo: Slo
) -> CapacityProfile:
    """What a profiling run on this mix would measure: prefill tokens/s at the mean prompt,
    decode points at the batch sizes the KV pool holds, the start-up time."""
    context = input_tokens + output_tokens / 2
    limit = cost.kv_batch_limit(input_tokens, output_tokens)
    batches = sorted({b for b in PROFILE_BATCHES if b <= limit} | {limit})
    points = tuple(
        DecodePoint(b, b / cost.itl_s(b, context), cost.itl_s(b, context)) for b in batches
    )
    try:
        at_slo = max_batch_within_itl(points, slo.tpot_s)
    except ValueError:
        at_slo = 1
    return CapacityProfile(
        prefill_tokens_per_s=cost.prefill_rate_at(input_tokens),
        decode_points=points,
        decode_max_batch_at_slo=at_slo,
        startup_s=cost.startup_s,
    )
