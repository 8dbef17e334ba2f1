"""Throughput against transformers, and decode step time against the memory floor.

Throughput: a seeded mixed workload (random token ids; prompt and output lengths uniform in
their ranges, outputs forced to length), run by the engine, by transformers' ``generate``
in static batches and by transformers' continuous batching, one after the other on the same
device. Output tokens per second of generation (model building excluded).

Decode step time: ``batch`` sequences with ``context`` tokens each, every one decoding; the
mean wall time of an engine step (schedule, forward, sample, the host read of the tokens).
Its floor is the bytes a step must move, weights plus the batch's KV, at the copy bandwidth
this device reaches on a large device-to-device copy measured in the same run.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from pdserve.bench.baselines_hf import generate_continuous, generate_static
from pdserve.bench.gpu_check.models import EngineTarget, ModelPair, engine
from pdserve.bench.workload import WorkloadItem
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.worker_state import TORCH_DTYPES


@dataclass(slots=True, frozen=True)
class WorkloadShape:
    num_requests: int
    min_prompt_tokens: int
    max_prompt_tokens: int
    min_output_tokens: int
    max_output_tokens: int


def make_workload(shape: WorkloadShape, vocab_size: int, seed: int) -> list[WorkloadItem]:
    rng = random.Random(seed)
    items = []
    for _ in range(shape.num_requests):
        length = rng.randint(shape.min_prompt_tokens, shape.max_prompt_tokens)
        prompt = tuple(rng.randrange(1, vocab_size) for _ in range(length))
        items.append((prompt, rng.randint(shape.min_output_tokens, shape.max_output_tokens)))
    return items


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_throughput(
    pair: ModelPair,
    target: EngineTarget,
    workload: Sequence[WorkloadItem],
    kv_budget_bytes: int,
) -> float:
    """Output tokens/s of the engine over ``workload`` (all requests queued at once)."""
    llm = engine(
        pair,
        target,
        memory_budget_bytes=kv_budget_bytes,
        max_num_seqs=min(256, len(workload)),
        max_num_batched_tokens=4096,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in workload]
    prompts = [list(p) for p, _ in workload]
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[:2], warm)  # first-call costs (kernel loading) out of the clock
    _synchronize(target.device)
    start_s = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    _synchronize(target.device)
    wall_s = time.perf_counter() - start_s
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == sum(o for _, o in workload), "the engine cut an output short"
    return generated / wall_s


def hf_static_throughput(
    pair: ModelPair, workload: Sequence[WorkloadItem], batch_size: int
) -> float:
    wall_s = generate_static(pair.hf, workload, batch_size, "transformers static batches")
    return sum(o for _, o in workload) / wall_s


def hf_continuous_throughput(
    pair: ModelPair, workload: Sequence[WorkloadItem], max_requests_per_step: int
) -> float:
    generated, wall_s = generate_continuous(
        pair.hf, workload, 4096, max_requests_per_step, "transformers continuous batching"
    )
    return sum(generated) / wall_s


def copy_bandwidth_bytes_per_s(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes read plus written per second by a device-to-device copy of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    _synchronize(device)
    start_s = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _synchronize(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start_s)


@dataclass(slots=True, frozen=True)
class StepTiming:
    batch: int
    context_tokens: int
    step_s: float
    floor_s: float


def decode_step_times(
    pair: ModelPair,
    target: EngineTarget,
    batches: Sequence[int],
    context_tokens: int,
    steps: int,
    cuda_graphs: bool,
    bandwidth_bytes_per_s: float,
) -> list[StepTiming]:
    """Mean decode step time per batch size (one engine, batches run one after another)."""
    biggest = max(batches)
    llm = engine(
        pair,
        target,
        cuda_graphs=cuda_graphs,
        max_num_seqs=biggest,
        max_num_batched_tokens=max(4096, biggest),
        num_blocks=biggest * (-(-(context_tokens + 2 * steps + 8) // 16)) + 8,
        enable_prefix_caching=False,
    )
    weight_bytes = sum(p.numel() * p.element_size() for p in pair.loaded.model.parameters())
    kv_per_token = pair.shape.kv_bytes_per_token(TORCH_DTYPES[pair.dtype])
    rng = random.Random(batches[0])
    timings = []
    label = "graphs" if cuda_graphs else "eager"
    for batch in tqdm(batches, desc=f"decode steps ({label})", unit="batch size"):
        params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 4, ignore_eos=True)
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for request_id in ids:
            prompt = [rng.randrange(1, pair.shape.vocab_size) for _ in range(context_tokens)]
            llm.engine.add_request(request_id, prompt, params)
        while not _all_decoding(llm, ids):  # prefill, then a few decode steps as warm-up
            llm.engine.step()
        for _ in range(3):
            llm.engine.step()
        _synchronize(target.device)
        start_s = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        _synchronize(target.device)
        step_s = (time.perf_counter() - start_s) / steps
        for request_id in ids:
            llm.engine.abort(request_id)
        mean_context = context_tokens + steps
        floor_s = (weight_bytes + batch * mean_context * kv_per_token) / bandwidth_bytes_per_s
        timings.append(StepTiming(batch, mean_context, step_s, floor_s))
    return timings


def _all_decoding(llm: LLM, request_ids: Sequence[str]) -> bool:
    """Every request has its prompt computed (its first token sampled)."""
    scheduler = llm.engine.scheduler
    decoding = {seq.seq_id for seq in scheduler.decoding()}
    return all(request_id in decoding for request_id in request_ids)
