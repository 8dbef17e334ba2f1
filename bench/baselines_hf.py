"""Hugging Face transformers baselines for the offline throughput benchmark.

(a) ``run_hf_static``: ``model.generate`` over static batches (16 by default) in workload
    order, left-padded. Each batch runs to its longest requested output
    (``min_new_tokens == max_new_tokens`` keeps EOS from ending rows early); only the tokens
    each request asked for count as useful output.
(b) ``run_hf_continuous``: transformers' own continuous batching (paged KV cache, CPU). This
    is the machinery behind ``model.generate_batch``; we drive its manager directly because
    ``generate_batch`` takes a single ``max_new_tokens`` for all requests, while each request
    here has its own. EOS is disabled (``eos_token_id=-1``) so lengths are exact. At most
    ``CB_MAX_REQUESTS_PER_STEP`` requests run per step: its fastest setting on CPU (see there).

Both load the GGUF through ``from_pretrained(..., gguf_file=...)`` (dequantized to ``dtype``),
time generation only, and report the peak RSS measured from just before generation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pdserve.bench.workload import (
    RunResult,
    WorkloadItem,
    default_model_file,
    peak_rss_bytes,
    reset_peak_rss,
)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CB_PAGE_TOKENS = 256  # transformers' default page size for its paged cache
# Requests per step for (b). With no flash kernel (none on CPU), transformers packs a step's
# requests into one sequence and runs SDPA over all their gathered KV (copied to every query
# head) under a block-diagonal mask: a step costs (query tokens) x (sum of the scheduled
# requests' lengths). With all 64 per step, 2048-token prompt steps took 7 s growing to 35 s+
# and the run ~2x longer. Full workload, 1 thread, fp32: 2 -> 1053 s, 4 -> 1173 s; 1 is slower
# (weights read per token), 3 within a few % of 2.
CB_MAX_REQUESTS_PER_STEP = 2


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {name!r}")
    return TORCH_DTYPES[name]


def load_hf_model(dtype: str, model_file: Path | None = None) -> Any:
    """The reference transformers model on CPU, weights dequantized from the GGUF to ``dtype``."""
    from transformers import AutoModelForCausalLM

    path = model_file or default_model_file()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch_dtype(dtype)
    )
    return model.eval()


def run_hf_static(workload: Sequence[WorkloadItem], dtype: str, batch_size: int = 16) -> RunResult:
    """Baseline (a): static batches of ``batch_size`` through ``model.generate``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    model = load_hf_model(dtype)
    reset_peak_rss()
    wall_s = generate_static(model, workload, batch_size, f"hf-static {dtype}")
    return RunResult(
        system="hf-static",
        prompt_tokens=sum(len(p) for p, _ in workload),
        output_tokens=sum(o for _, o in workload),
        wall_s=wall_s,
        peak_rss_bytes=peak_rss_bytes(),
    )


def generate_static(
    model: Any, workload: Sequence[WorkloadItem], batch_size: int, desc: str
) -> float:
    """Seconds ``model.generate`` takes over ``workload`` in static batches of
    ``batch_size`` (on the model's device, which is synchronized before the clock stops)."""
    pad_id = int(model.generation_config.pad_token_id or 0)
    batches = [workload[i : i + batch_size] for i in range(0, len(workload), batch_size)]
    start_s = time.perf_counter()
    for batch in tqdm(batches, desc=desc, unit="batch"):
        _generate_static_batch(model, batch, pad_id)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - start_s


@torch.inference_mode()
def _generate_static_batch(model: Any, batch: Sequence[WorkloadItem], pad_id: int) -> None:
    max_prompt = max(len(p) for p, _ in batch)
    max_new = max(o for _, o in batch)
    input_ids = torch.full((len(batch), max_prompt), pad_id, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros((len(batch), max_prompt), dtype=torch.long)  # [B, L]
    for row, (prompt, _) in enumerate(batch):
        # Left padding: every prompt ends at the last column, where generation continues.
        input_ids[row, max_prompt - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, max_prompt - len(prompt) :] = 1
    out = model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        do_sample=False,
        pad_token_id=pad_id,
    )
    assert out.shape == (len(batch), max_prompt + max_new), (
        f"generate returned {tuple(out.shape)}, expected {(len(batch), max_prompt + max_new)}"
    )


def run_hf_continuous(
    workload: Sequence[WorkloadItem], dtype: str, max_batch_tokens: int = 2048
) -> RunResult:
    """Baseline (b): transformers' continuous batching, KV sized to hold every request."""
    model = load_hf_model(dtype)
    reset_peak_rss()
    generated, wall_s = generate_continuous(
        model, workload, max_batch_tokens, CB_MAX_REQUESTS_PER_STEP, f"hf-cb {dtype}"
    )
    requested = [o for _, o in workload]
    assert generated == requested, f"generated lengths {generated} != requested {requested}"
    return RunResult(
        system="hf-cb",
        prompt_tokens=sum(len(p) for p, _ in workload),
        output_tokens=sum(generated),
        wall_s=wall_s,
        peak_rss_bytes=peak_rss_bytes(),
    )


def generate_continuous(
    model: Any,
    workload: Sequence[WorkloadItem],
    max_batch_tokens: int,
    max_requests_per_step: int,
    desc: str,
) -> tuple[list[int], float]:
    """transformers' continuous batching over ``workload``, its KV sized to hold every
    request: generated lengths in order, and the seconds generation took."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # On CPU it would otherwise size its cache from 60% of system RAM. Holding every request,
    # it stays clear of the 15%-free safety margin under which no new prompt is admitted.
    cb_config = ContinuousBatchingConfig(
        page_size=CB_PAGE_TOKENS,
        num_blocks=sum(math.ceil((len(p) + o) / CB_PAGE_TOKENS) for p, o in workload),
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=min(len(workload), max_requests_per_step),
    )
    gen_config = GenerationConfig(
        do_sample=False, max_new_tokens=max(o for _, o in workload), eos_token_id=-1
    )
    with model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=30
    ) as manager:
        start_s = time.perf_counter()
        generated = _drive_continuous(manager, workload, desc)
        wall_s = time.perf_counter() - start_s
    return generated, wall_s


def _drive_continuous(manager: Any, workload: Sequence[WorkloadItem], desc: str) -> list[int]:
    """Submit everything at once, wait for every result; returns generated lengths in order."""
    for i, (prompt, output_tokens) in enumerate(workload):
        manager.add_request(
            list(prompt), request_id=f"req{i}", max_new_tokens=output_tokens, eos_token_id=-1
        )
    lengths: dict[str, int] = {}
    with tqdm(total=len(workload), desc=desc, unit="req") as progress:
        while len(lengths) < len(workload):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(
                        f"transformers' continuous batching stopped after "
                        f"{len(lengths)}/{len(workload)} requests"
                    )
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                lengths[result.request_id] = len(result.generated_tokens)
                progress.update(1)
    return [lengths[f"req{i}"] for i in range(len(workload))]
