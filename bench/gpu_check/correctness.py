"""Logits and greedy tokens of the engine against transformers on the same weights.

Greedy: 8 prompts (four share a prefix, so prefix caching has something to hit), each run
twice through one engine (the second pass reads the first pass's cached prefix blocks),
under the baseline settings and with each technique switched: CUDA graphs, prefix caching,
chunked prefill. Logits: every row the engine sampled from (prefill and decode steps),
against transformers' forward over the same tokens (teacher forcing, so a bf16 run that
greedily drifts away from fp32 is still compared position by position).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from pdserve.bench.gpu_check.models import EngineTarget, ModelPair, engine
from pdserve.bench.gpu_check.report import Check
from pdserve.engine import SamplingParams
from pdserve.engine.engine import StepRecord

FP32_LOGITS_MAX_ABS = 1e-3
# bf16 rounds weights and activations to 8 significant bits; over a deep stack the logits
# of the two implementations (different kernels, different rounding points) drift by a few
# hundredths. The bound is wide enough for that and far below a wrong model (errors of 1+).
BF16_LOGITS_MAX_ABS = 0.25

# (label, engine options) in addition to the baseline: each switches one technique.
BASELINE: dict[str, Any] = {
    "cuda_graphs": True,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
}
VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("baseline (graphs, prefix caching, chunked prefill)", {}),
    ("CUDA graphs off", {"cuda_graphs": False}),
    ("prefix caching off", {"enable_prefix_caching": False}),
    ("chunked prefill off", {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096}),
)


@dataclass(slots=True, frozen=True)
class GreedySetup:
    num_prompts: int
    new_tokens: int
    min_prompt_tokens: int
    max_prompt_tokens: int
    shared_prefix_tokens: int
    chunk_tokens: int  # the step budget when chunking: below the longest prompt
    max_num_seqs: int


def make_prompts(setup: GreedySetup, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, vocab_size) for _ in range(setup.shared_prefix_tokens)]
    prompts = []
    for i in range(setup.num_prompts):
        length = rng.randint(setup.min_prompt_tokens, setup.max_prompt_tokens)
        head = shared if i % 2 == 0 else []
        prompts.append(head + [rng.randrange(1, vocab_size) for _ in range(length - len(head))])
    return prompts


@torch.inference_mode()
def hf_greedy(hf: Any, prompts: Sequence[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations, one prompt at a time (no padding involved)."""
    outputs = []
    for prompt in tqdm(prompts, desc="transformers greedy", unit="prompt"):
        ids = torch.tensor([prompt], device=hf.device)
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


class LogitsRecorder:
    """Collects the logits row the engine sampled each sequence's tokens from, in order."""

    def __init__(self) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.enabled = True

    def __call__(self, record: StepRecord) -> None:
        if not self.enabled:
            return
        row = 0
        for chunk in record.plan.chunks:
            for offset in range(chunk.num_sampled_rows):
                logits = record.logits[row + offset].float().cpu()
                self.rows.setdefault(chunk.seq_id, []).append(logits)
            row += chunk.num_sampled_rows

    def of(self, request_id: str) -> torch.Tensor:
        return torch.stack(self.rows[request_id])  # [new_tokens, vocab]


def engine_greedy(
    pair: ModelPair,
    target: EngineTarget,
    prompts: Sequence[list[int]],
    setup: GreedySetup,
    options: dict[str, Any],
    passes: int = 2,
) -> tuple[list[list[list[int]]], LogitsRecorder]:
    """Each pass's greedy tokens, and the logits of the first pass."""
    # A pool for every sequence at once, twice over: the second pass finds the first's
    # prefix blocks still cached.
    blocks_per_seq = -(-(setup.max_prompt_tokens + setup.new_tokens) // target.block_size)
    sizes = {
        "max_num_batched_tokens": setup.chunk_tokens,
        "max_num_seqs": setup.max_num_seqs,
        "num_blocks": 2 * setup.num_prompts * blocks_per_seq,
    }
    settings = {**BASELINE, **sizes, **options}
    llm = engine(pair, target, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=setup.new_tokens, ignore_eos=True)
    recorder = LogitsRecorder()
    llm.engine.add_step_observer(recorder)
    runs = []
    for run in range(passes):
        recorder.enabled = run == 0
        outputs = llm.generate([list(p) for p in prompts], params)
        runs.append([list(o.outputs[0].token_ids) for o in outputs])
    return runs, recorder


@torch.inference_mode()
def logits_max_abs(
    hf: Any,
    prompts: Sequence[list[int]],
    generated: Sequence[list[int]],
    recorder: LogitsRecorder,
    first_request_id: int,
) -> float:
    """Largest |engine - transformers| over every sampled row of every prompt."""
    worst = 0.0
    for i, (prompt, tokens) in enumerate(zip(prompts, generated, strict=True)):
        ids = torch.tensor([prompt + tokens[:-1]], device=hf.device)
        reference = hf(ids).logits[0, len(prompt) - 1 :].float().cpu()  # [new_tokens, vocab]
        ours = recorder.of(str(first_request_id + i))
        worst = max(worst, float((ours - reference).abs().max()))
    return worst


def greedy_checks(
    pair: ModelPair,
    target: EngineTarget,
    setup: GreedySetup,
    seed: int,
) -> list[Check]:
    """Greedy identity (fp32) under every variant, and the fp32 logits bound."""
    prompts = make_prompts(setup, pair.shape.vocab_size, seed)
    reference = hf_greedy(pair.hf, prompts, setup.new_tokens)
    checks = []
    for label, options in tqdm(VARIANTS, desc=f"{pair.shape.name} greedy variants"):
        runs, recorder = engine_greedy(pair, target, prompts, setup, options)
        same = sum(run == reference for run in runs)
        checks.append(
            Check(
                f"{pair.shape.name} fp32 greedy, {label}",
                f"{same}/{len(runs)} passes identical ({_first_difference(runs, reference)})",
                f"{len(prompts)} prompts x {setup.new_tokens} tokens identical to transformers",
                same == len(runs),
            )
        )
        if not options:  # the baseline run: its logits against transformers'
            worst = logits_max_abs(pair.hf, prompts, runs[0], recorder, 0)
            checks.append(_logits_check(pair, worst, FP32_LOGITS_MAX_ABS))
    return checks


def bf16_logits_check(
    pair: ModelPair, target: EngineTarget, setup: GreedySetup, seed: int
) -> Check:
    prompts = make_prompts(setup, pair.shape.vocab_size, seed)
    runs, recorder = engine_greedy(pair, target, prompts, setup, {}, passes=1)
    worst = logits_max_abs(pair.hf, prompts, runs[0], recorder, 0)
    return _logits_check(pair, worst, BF16_LOGITS_MAX_ABS)


def _logits_check(pair: ModelPair, worst: float, bound: float) -> Check:
    return Check(
        f"{pair.shape.name} {pair.dtype} logits vs transformers",
        f"max abs {worst:.2e}",
        f"<= {bound:g}",
        worst <= bound,
    )


def _first_difference(runs: Sequence[list[list[int]]], reference: list[list[int]]) -> str:
    for run in runs:
        for prompt, (ours, theirs) in enumerate(zip(run, reference, strict=True)):
            if ours != theirs:
                pairs = enumerate(zip(ours, theirs, strict=False))
                at = next((i for i, (a, b) in pairs if a != b), min(len(ours), len(theirs)))
                return f"prompt {prompt} differs from token {at}"
    return "no difference"
