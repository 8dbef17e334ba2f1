"""`pdserve profile`: measure what one worker of this machine can do, for the autoscaler.

It runs the engine in this process on random prompts (no prefix-cache hits) and times every
step through the engine's step observer:

* prefill: prompt tokens per second of prefill-only steps;
* decode: for each batch size, the median time of steps that decode exactly that many
  sequences (the ITL at that batch) and the output tokens per second it gives;
* start-up: a real worker process (``python -m pdserve.worker.server``) from launch until it
  serves (model loaded and warm), as the planner must wait for a new replica.

The result (``CapacityProfile`` plus model, dtype, CPU and date) goes to a JSON file and,
with ``--redis-url``, into the cluster's Redis, where `pdserve planner` reads it.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from pdserve.cluster.autoscale import CapacityProfile, DecodePoint, max_batch_within_itl
from pdserve.cluster.settings import Settings

if TYPE_CHECKING:
    from pdserve.engine import LLM
    from pdserve.engine.engine import StepRecord
    from pdserve.engine.scheduler.plan import ScheduledChunk

DEFAULT_OUT = Path.home() / ".pdserve" / "profile.json"
STARTUP_TIMEOUT_S = 600.0


def _is_decode(chunk: ScheduledChunk) -> bool:
    return chunk.num_tokens == 1 and chunk.start_pos > 0


def is_decode_only(record: StepRecord) -> bool:
    return all(_is_decode(c) for c in record.plan.chunks)


def decode_point(records: Sequence[StepRecord], batch_size: int) -> DecodePoint:
    """The median decode step of exactly ``batch_size`` sequences (pure)."""
    times = [r.step_s for r in records if is_decode_only(r) and len(r.plan.chunks) == batch_size]
    if not times:
        raise ValueError(f"no decode step ran {batch_size} sequences; use more decode tokens")
    itl_s = statistics.median(times)
    return DecodePoint(batch_size, batch_size / itl_s, itl_s)


def prefill_rate(records: Sequence[StepRecord]) -> float:
    """Prompt tokens per second over the steps that only prefilled (pure)."""
    prefill = [r for r in records if not any(_is_decode(c) for c in r.plan.chunks)]
    tokens = sum(r.plan.num_batched_tokens for r in prefill)
    seconds = sum(r.step_s for r in prefill)
    if not tokens or seconds <= 0:
        raise ValueError("no prefill step was measured")
    return tokens / seconds


def _random_prompts(count: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(tokens)] for _ in range(count)]


def measure_engine(
    llm: LLM, batch_sizes: Sequence[int], prompt_tokens: int, decode_tokens: int
) -> tuple[float, list[DecodePoint]]:
    """Prefill tokens/s and one decode point per batch size, from the engine's own steps."""
    from pdserve.engine import SamplingParams

    records: list[StepRecord] = []
    llm.engine.add_step_observer(records.append)
    vocab = llm.engine.model_config.vocab_size
    llm.generate(_random_prompts(4, prompt_tokens, vocab, 0), SamplingParams(max_tokens=1))
    prefill = prefill_rate(records)
    points = []
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    for batch in tqdm(batch_sizes, desc="decode batches", unit="batch"):
        records.clear()
        llm.generate(_random_prompts(batch, 16, vocab, batch), params)
        points.append(decode_point(records, batch))
    return prefill, points


def measure_startup(model: str, dtype: str) -> float:
    """Seconds from launching a decode worker process until it serves (ready file)."""
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready.json"
        args = [sys.executable, "-m", "pdserve.worker.server", "--role", "decode", "--port",
                "0", "--metrics-port", "-1", "--model", model, "--dtype", dtype,
                "--ready-file", str(ready)]  # fmt: skip
        start_s = time.monotonic()
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() - start_s > STARTUP_TIMEOUT_S:
                    raise RuntimeError(f"the worker did not start (exit code {proc.poll()})")
                time.sleep(0.05)
            return time.monotonic() - start_s
        finally:
            proc.terminate()
            proc.wait(30)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("profile", help="measure one worker's capacity for the autoscaler",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add = p.add_argument
    add("--model", default="smollm2-135m-instruct")
    add("--dtype", default="float32", choices=["float32", "bfloat16"])
    add("--batch-sizes", default="1,2,4,8,16,32", help="decode batch sizes to time")
    add("--prompt-tokens", type=int, default=512, help="tokens per prefill prompt")
    add("--decode-tokens", type=int, default=24, help="tokens generated per decode sequence")
    add("--itl-slo-ms", type=float, default=100.0, help="the inter-token latency target")
    add("--out", type=Path, default=DEFAULT_OUT, help="where the profile goes (JSON)")
    add("--torch-threads", type=int, default=Settings.from_env().torch_threads,
        help="threads of the engine, as a worker has (PDSERVE_TORCH_THREADS)")  # fmt: skip
    add("--redis-url", default=None, help="also store it in this cluster's Redis")
    add("--key-prefix", default="pdserve:")
    p.set_defaults(run=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    from pdserve.engine import LLM

    batches = [int(b) for b in args.batch_sizes.split(",")]
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    llm = LLM(model=args.model, dtype=args.dtype)
    prefill, points = measure_engine(llm, batches, args.prompt_tokens, args.decode_tokens)
    profile = CapacityProfile(
        prefill,
        tuple(points),
        max_batch_within_itl(points, args.itl_slo_ms / 1000),
        measure_startup(args.model, args.dtype),
    )
    document = {
        "model": args.model,
        "dtype": args.dtype,
        "cpu": platform.processor() or platform.machine(),
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "profile": profile.to_dict(),
    }
    text = json.dumps(document, indent=2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if args.redis_url:
        import redis

        from pdserve.proto.redis_keys import RedisKeys

        redis.Redis.from_url(args.redis_url).set(RedisKeys(args.key_prefix).capacity_profile, text)
    _print(profile, args.out)
    return 0


def _print(profile: CapacityProfile, out: Path) -> None:
    print(f"prefill  {profile.prefill_tokens_per_s:,.0f} tokens/s")
    print("decode   batch  tokens/s  ITL ms")
    for p in profile.decode_points:
        print(f"         {p.batch_size:>5}  {p.tokens_per_s:>8.1f}  {1000 * p.itl_s:>6.1f}")
    print(f"largest batch within the ITL target: {profile.decode_max_batch_at_slo}")
    print(f"start-up {profile.startup_s:.1f} s")
    print(f"written to {out}")
