"""The command: parse, run every check in order, print each result as it comes and the
summary table at the end; exit status 0 when every judged check passes."""

from __future__ import annotations

import argparse
import functools
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.bench.gpu_check import correctness, speed
from pdserve.bench.gpu_check.correctness import GreedySetup
from pdserve.bench.gpu_check.models import (
    LLAMA_1B,
    SMOLLM2_135M,
    TINY_1B,
    TINY_SMOLLM2,
    EngineTarget,
    ModelPair,
    Shape,
    build_pair,
    in_dtype,
)
from pdserve.bench.gpu_check.report import Check, summary_table
from pdserve.bench.gpu_check.speed import StepTiming, WorkloadShape
from pdserve.engine.device import resolve_device

# The targets (issue 30).
STATIC_SPEEDUP = 5.0  # engine vs transformers generate in static batches, 1B bf16
CONTINUOUS_SPEEDUP = 3.0  # vs transformers' continuous batching
BATCH1_FLOOR_FACTOR = 2.0  # batch-1 decode step with graphs within 2x of the floor
GRAPH_SPEEDUP = 1.5  # graphs vs eager at batch 1


@dataclass(slots=True, frozen=True)
class Profile:
    """Sizes of one run: the real one, or ``--tiny``."""

    small: Shape
    large: Shape
    greedy: GreedySetup
    workload: WorkloadShape
    static_batch: int
    continuous_requests_per_step: int
    kv_budget_bytes: int
    decode_batches: tuple[int, ...]
    decode_context_tokens: int
    decode_steps: int
    copy_bytes: int


FULL = Profile(
    small=SMOLLM2_135M,
    large=LLAMA_1B,
    greedy=GreedySetup(8, 64, 24, 320, 48, 128, 64),
    workload=WorkloadShape(256, 32, 2048, 16, 512),
    static_batch=32,
    continuous_requests_per_step=256,
    kv_budget_bytes=24 * 1024**3,
    decode_batches=(1, 16, 64, 256),
    decode_context_tokens=512,
    decode_steps=32,
    copy_bytes=2 * 1024**3,
)
TINY = Profile(
    small=TINY_SMOLLM2,
    large=TINY_1B,
    greedy=GreedySetup(8, 8, 8, 40, 8, 16, 8),
    workload=WorkloadShape(8, 16, 64, 4, 16),
    static_batch=4,
    continuous_requests_per_step=2,
    kv_budget_bytes=64 * 1024**2,
    decode_batches=(1, 4),
    decode_context_tokens=16,
    decode_steps=4,
    copy_bytes=64 * 1024**2,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.gpu_check",
        description="The engine on a GPU against transformers, on seeded random weights in "
        "SmolLM2-135M's and a 1B Llama's shapes (no model files): logits, greedy tokens, "
        "throughput, decode step time against the memory floor.",
    )
    add = p.add_argument
    add(
        "--tiny", action="store_true", help="toy sizes: a dry run of every check (speed not judged)"
    )
    add("--device", default="auto", help="auto = cuda when torch sees a GPU, else cpu")
    add("--attention-backend", default="auto", help="the engine's (default: auto, by device)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (default: 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-speed", action="store_true", help="correctness checks only")
    return p


class Run:
    """The checks so far. A section that raises becomes a failed check and the run goes
    on: on a GPU lent for minutes, one broken part must not cost the rest."""

    def __init__(self) -> None:
        self.checks: list[Check] = []

    def report(self, new: list[Check]) -> None:
        for check in new:
            print(check.line(), flush=True)
        self.checks.extend(new)

    def section(self, name: str, body: Callable[[], list[Check]]) -> None:
        try:
            new = body()
        except Exception as exc:  # reported as a failure, with its traceback above it
            traceback.print_exc()
            new = [Check(name, f"raised {type(exc).__name__}: {exc}"[:200], "runs", False)]
        self.report(new)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    profile = TINY if args.tiny else FULL
    device = resolve_device(args.device)
    started = time.perf_counter()
    print(f"gpu_check on {_device_name(device)}, torch {torch.__version__}", flush=True)
    run = Run()
    target = EngineTarget(device, args.attention_backend, args.block_size)
    for shape in (profile.small, profile.large):
        speed_checks = shape == profile.large and not args.skip_speed
        checks = functools.partial(
            _shape_checks, run, shape, target, profile, args.seed, speed_checks, not args.tiny
        )
        run.section(f"{shape.name} checks", checks)
    print(f"\n{summary_table(run.checks)}\n\ntotal {time.perf_counter() - started:.0f}s")
    failed = [c.name for c in run.checks if c.passed is False]
    print("ALL JUDGED CHECKS PASS" if not failed else f"FAILED: {len(failed)} check(s)")
    return 1 if failed else 0


def _shape_checks(
    run: Run,
    shape: Shape,
    target: EngineTarget,
    profile: Profile,
    seed: int,
    speed_checks: bool,
    judged: bool,
) -> list[Check]:
    """Correctness in fp32 and bf16, then (the large shape) speed in bf16; each section
    reports through ``run`` as it ends."""
    pair = build_pair(shape, target.device, seed)
    greedy = functools.partial(correctness.greedy_checks, pair, target, profile.greedy, seed)
    run.section(f"{shape.name} fp32 greedy", greedy)
    bf16 = in_dtype(pair, "bfloat16")
    del pair  # the fp32 copies: a 1B model's are 10 GB
    run.section(
        f"{shape.name} bf16 logits",
        lambda: [correctness.bf16_logits_check(bf16, target, profile.greedy, seed)],
    )
    if speed_checks:
        run.section(
            f"{shape.name} throughput",
            lambda: _throughput_checks(run, bf16, target, profile, judged),
        )
        run.section(
            f"{shape.name} decode steps", lambda: _decode_checks(bf16, target, profile, judged)
        )
    return []


def _throughput_checks(
    run: Run, pair: ModelPair, target: EngineTarget, profile: Profile, judged: bool
) -> list[Check]:
    workload = speed.make_workload(profile.workload, pair.shape.vocab_size, seed=1)
    ours = speed.engine_throughput(pair, target, workload, profile.kv_budget_bytes)
    print(f"engine: {ours:,.0f} output tok/s", flush=True)
    name = f"{pair.shape.name} {pair.dtype}, {len(workload)} requests: output tok/s vs"
    static_name = f"{name} transformers static"
    run.section(
        static_name,
        lambda: [
            _ratio_check(
                static_name,
                ours,
                speed.hf_static_throughput(pair, workload, profile.static_batch),
                STATIC_SPEEDUP,
                judged,
            )
        ],
    )
    continuous_name = f"{name} transformers continuous batching"
    run.section(
        continuous_name,
        lambda: [
            _ratio_check(
                continuous_name,
                ours,
                speed.hf_continuous_throughput(
                    pair, workload, profile.continuous_requests_per_step
                ),
                CONTINUOUS_SPEEDUP,
                judged,
            )
        ],
    )
    return []


def _decode_checks(
    pair: ModelPair, target: EngineTarget, profile: Profile, judged: bool
) -> list[Check]:
    bandwidth = speed.copy_bandwidth_bytes_per_s(target.device, profile.copy_bytes)
    print(f"device copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    timings = {
        graphs: speed.decode_step_times(
            pair,
            target,
            profile.decode_batches,
            profile.decode_context_tokens,
            profile.decode_steps,
            graphs,
            bandwidth,
        )
        for graphs in (True, False)
    }
    checks = [
        _step_line(pair, graphed, eager)
        for graphed, eager in zip(timings[True], timings[False], strict=True)
    ]
    batch1_graphed, batch1_eager = timings[True][0], timings[False][0]
    factor = batch1_graphed.step_s / batch1_graphed.floor_s
    checks.append(
        Check(
            f"{pair.shape.name} batch-1 decode step with graphs vs floor",
            f"{factor:.2f}x the floor",
            f"<= {BATCH1_FLOOR_FACTOR:g}x",
            factor <= BATCH1_FLOOR_FACTOR if judged else None,
        )
    )
    checks.append(
        _ratio_check(f"{pair.shape.name} batch-1 decode: graphs vs eager",
                     1 / batch1_graphed.step_s, 1 / batch1_eager.step_s, GRAPH_SPEEDUP, judged)
    )  # fmt: skip
    return checks


def _ratio_check(name: str, ours: float, theirs: float, target: float, judged: bool) -> Check:
    ratio = ours / theirs
    return Check(
        name,
        f"{ratio:.2f}x ({ours:,.0f} vs {theirs:,.0f} per s)",
        f">= {target:g}x",
        ratio >= target if judged else None,
    )


def _step_line(pair: ModelPair, graphed: StepTiming, eager: StepTiming) -> Check:
    return Check(
        f"{pair.shape.name} decode step, batch {graphed.batch}, context {graphed.context_tokens}",
        f"graphs {graphed.step_s * 1e3:.2f} ms, eager {eager.step_s * 1e3:.2f} ms, "
        f"floor {graphed.floor_s * 1e3:.2f} ms",
        "measured only",
        None,
    )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} (no GPU: correctness only means something here; speed is not judged)"
