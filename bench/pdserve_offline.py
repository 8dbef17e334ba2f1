"""System (c) of the engine throughput benchmark: pdserve's engine, offline, colocated."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm import tqdm

from pdserve.bench.workload import RunResult, WorkloadItem, peak_rss_bytes, reset_peak_rss

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def run_pdserve(workload: Sequence[WorkloadItem], dtype: str) -> RunResult:
    """The whole workload through one engine, every request queued at once (ignore_eos).

    Model loading is outside the timed region, as for the transformers baselines.
    """
    from pdserve.engine import LLM, SamplingParams

    total_tokens = max(len(p) + o for p, o in workload)
    llm = LLM(dtype=DTYPES[dtype], max_model_len=total_tokens + 1)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in workload]
    prompts = [list(p) for p, _ in workload]
    reset_peak_rss()
    start_s = time.perf_counter()
    bar = tqdm(total=sum(o for _, o in workload), desc=f"pdserve {dtype}", unit="tok")
    results = llm.generate(prompts, params, on_step=lambda step: bar.update(len(step.token_ids)))
    wall_s = time.perf_counter() - start_s
    bar.close()
    produced = sum(len(r.token_ids) for r in results)
    expected = sum(o for _, o in workload)
    assert produced == expected, f"pdserve produced {produced} tokens, expected {expected}"
    return RunResult(
        system="pdserve",
        prompt_tokens=sum(len(p) for p, _ in workload),
        output_tokens=produced,
        wall_s=wall_s,
        peak_rss_bytes=peak_rss_bytes(),
    )
