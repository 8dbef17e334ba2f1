"""Where our engine's time goes against the floor, step by step.

    python -m pdserve.bench.step_profile --dtype bf16 [--num-requests 64] [--max-output N]

Runs the engine throughput workload (``bench/workload.py``) through our engine alone, times
every engine step, and applies the floor of ``bench/floor.py`` to each step the engine
really ran (its tokens, attended positions, KV read and sampled rows) rather than to the
ideal schedule. Steps are grouped by kind: decode-only (by batch size, in buckets of 16),
prefill-only and mixed. A kind whose ratio stands out is where the time goes.

Next to the floor (memory time and matmul time overlapped: their max) it prints the serial
floor (their sum): what a step costs when its memory-bound part (decode attention reading
the KV) and its compute-bound part (the linears) run one after the other, as separate
kernels on the same cores do.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pdserve.bench.baselines_hf import torch_dtype
from pdserve.bench.engine_throughput import load_workload
from pdserve.bench.floor import (
    ModelShape,
    Roofline,
    StepShape,
    best_reading,
    measure_roofline,
    step_costs_s,
)
from pdserve.bench.pdserve_offline import DTYPES
from pdserve.engine.engine import LLMEngine
from pdserve.engine.scheduler.plan import BatchPlan

DECODE_BUCKET = 16  # decode-only steps are grouped by batch size, rounded up to this


def step_shape(plan: BatchPlan) -> StepShape:
    """The cost-relevant shape of a step the engine ran (see ``pdserve.bench.floor.StepShape``)."""
    chunks = plan.chunks
    # token j (0-based) of a chunk starting at position s attends to s + j + 1 positions
    attended = sum(
        c.num_tokens * c.start_pos + c.num_tokens * (c.num_tokens + 1) // 2 for c in chunks
    )
    return StepShape(
        num_tokens=plan.num_batched_tokens,
        attended_context_tokens=attended,
        num_sampled=sum(c.sample for c in chunks),
        kv_read_tokens=sum(c.start_pos for c in chunks),
    )


def step_kind(plan: BatchPlan) -> str:
    """``decode B<=n``, ``prefill`` or ``mixed``; a chunk of one token counts as a decode."""
    decodes = sum(c.num_tokens == 1 for c in plan.chunks)
    if decodes == len(plan.chunks):
        bucket = -(-decodes // DECODE_BUCKET) * DECODE_BUCKET
        return f"decode B<={bucket}"
    return "prefill" if decodes == 0 else "mixed"


@dataclass(slots=True)
class KindTotals:
    steps: int = 0
    engine_s: float = 0.0
    floor_s: float = 0.0  # sum over steps of max(memory, compute)
    serial_s: float = 0.0  # sum over steps of memory + compute
    tokens: int = 0

    def add(self, other: KindTotals) -> None:
        self.steps += other.steps
        self.engine_s += other.engine_s
        self.floor_s += other.floor_s
        self.serial_s += other.serial_s
        self.tokens += other.tokens


def summarize(
    records: Iterable[tuple[float, BatchPlan]],
    costs_of: Callable[[StepShape], tuple[float, float]],
) -> dict[str, KindTotals]:
    """Engine and floor seconds per step kind, kinds in sorted order; ``costs_of`` gives a
    step's (memory, compute) seconds."""
    totals: dict[str, KindTotals] = {}
    for seconds, plan in records:
        shape = step_shape(plan)
        memory_s, compute_s = costs_of(shape)
        step = KindTotals(
            1, seconds, max(memory_s, compute_s), memory_s + compute_s, shape.num_tokens
        )
        totals.setdefault(step_kind(plan), KindTotals()).add(step)
    return dict(sorted(totals.items()))


def format_summary(totals: dict[str, KindTotals], roof: Roofline, dtype: str) -> str:
    header = (
        f"{'step kind':<14} {'steps':>6} {'tokens':>7} {'engine_s':>9} {'floor_s':>8} "
        f"{'ratio':>6} {'serial_s':>9} {'ratio':>6} {'ms/step':>8} {'floor ms':>9}"
    )
    lines = [header, "-" * len(header)]
    everything = KindTotals()
    for kind in totals.values():
        everything.add(kind)
    for name, kind in [*totals.items(), ("all", everything)]:
        lines.append(
            f"{name:<14} {kind.steps:>6} {kind.tokens:>7} {kind.engine_s:>9.2f} "
            f"{kind.floor_s:>8.2f} {kind.engine_s / kind.floor_s:>5.2f}x "
            f"{kind.serial_s:>9.2f} {kind.engine_s / kind.serial_s:>5.2f}x "
            f"{1000 * kind.engine_s / kind.steps:>8.1f} {1000 * kind.floor_s / kind.steps:>9.1f}"
        )
    lines.append(
        f"floor ({dtype}): memory bandwidth {roof.memory_bandwidth_gb_s:.1f} GB/s, "
        f"matmul {roof.matmul_gflop_s:.0f} GFLOP/s, the best of readings before and after the run"
    )
    return "\n".join(lines)


class StepRecorder:
    """Each step's wall time and plan, as the engine's step observer reports them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.records: list[tuple[float, BatchPlan]] = []
        engine.add_step_observer(lambda record: self.records.append((record.step_s, record.plan)))


def main(argv: Sequence[str] | None = None) -> None:
    from pdserve.engine import LLM, SamplingParams

    args = _parse_args(argv)
    workload = load_workload(args.num_requests, args.max_output, seed=0)
    dtype = torch_dtype(args.dtype)
    readings = [measure_roofline(dtype)]
    llm = LLM(dtype=DTYPES[args.dtype], max_model_len=max(len(p) + o for p, o in workload) + 1)
    recorder = StepRecorder(llm.engine)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in workload]
    llm.generate([list(p) for p, _ in workload], params, use_tqdm=True)
    readings.append(measure_roofline(dtype))
    roof = best_reading(readings)
    model = ModelShape()
    totals = summarize(
        recorder.records, lambda shape: step_costs_s(shape, model, roof, dtype.itemsize)
    )
    print(format_summary(totals, roof, args.dtype))


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=None, help="cap output lengths")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
