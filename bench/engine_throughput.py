"""Offline engine throughput: pdserve's engine vs transformers, side by side, same workload.

    python -m pdserve.bench.engine_throughput --dtype fp32 [--num-requests 64] [--max-output N]
                                      [--only hf-static,hf-cb,pdserve] [--json out.json]

Every system runs the same fixed seeded workload (``bench/workload.py``) in a fresh spawned
process, so its peak RSS is its own and no system warms caches for the next. Wall time
covers generation only. Output tok/s counts only the tokens each request asked for. The
floor is this machine's roofline over an ideal continuous-batching schedule
(``bench/floor.py``), the roofline read before and again after the systems run and taken at
its best (``best_reading``); the table ends with our wall time over that floor. Smoke run:
``--num-requests 4 --max-output 8``.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

from pdserve.bench.baselines_hf import run_hf_continuous, run_hf_static, torch_dtype
from pdserve.bench.floor import (
    ModelShape,
    Roofline,
    best_reading,
    floor_s,
    measure_roofline,
    simulate_schedule,
)
from pdserve.bench.pdserve_offline import run_pdserve
from pdserve.bench.workload import (
    RunResult,
    WorkloadItem,
    WorkloadSpec,
    build_workload,
    cap_output_tokens,
    default_model_file,
    load_tokenize,
)

RunSystem = Callable[[Sequence[WorkloadItem], str], RunResult]
SYSTEM_NAMES = ("hf-static", "hf-cb", "pdserve")
BASELINES = ("hf-static", "hf-cb")


@dataclass(slots=True, frozen=True)
class FloorResult:
    roofline: Roofline  # the best of readings, which the floor uses
    readings: tuple[Roofline, ...]  # in the order taken
    num_steps: int
    wall_s: float
    output_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    workload = load_workload(args.num_requests, args.max_output, args.seed)
    print(_describe_workload(workload, args.seed))
    torch_type = torch_dtype(args.dtype)
    readings = [measure_roofline(torch_type)]
    floor = compute_floor(workload, args.dtype, args.token_budget, args.max_seqs, readings)
    results = _reused_results(args)
    for name in args.only:
        results[name] = _run_isolated(_system(name, args), workload, args.dtype, name)
        print(_format_row(name, results[name], results), flush=True)
        if args.json:  # after every system: a long run that dies keeps what it measured
            _write_json(args.json, results, floor, args)
    readings.append(measure_roofline(torch_type))
    floor = compute_floor(workload, args.dtype, args.token_budget, args.max_seqs, readings)
    if args.json:
        _write_json(args.json, results, floor, args)
    print()
    print(format_table(results, floor, args.dtype))


def _reused_results(args: argparse.Namespace) -> dict[str, RunResult | str]:
    """Results of systems not run now, from an earlier ``--json`` file of the same workload."""
    if not args.reuse_json:
        return {}
    with open(args.reuse_json, encoding="utf-8") as f:
        payload = json.load(f)
    same = {k: payload.get(k) for k in ("dtype", "num_requests", "max_output", "seed")}
    wanted = {k: getattr(args, k) for k in same}
    if same != wanted:
        raise ValueError(f"{args.reuse_json} measured {same}, but this run is {wanted}")
    return {
        name: RunResult(**value)
        for name, value in payload["results"].items()
        if name not in args.only and isinstance(value, dict)
    }


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=None, help="cap output lengths")
    parser.add_argument("--only", type=_parse_only, default=SYSTEM_NAMES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--static-batch-size", type=int, default=16)
    parser.add_argument(
        "--token-budget", type=int, default=2048, help="per-step tokens (hf-cb, floor)"
    )
    parser.add_argument("--max-seqs", type=int, default=64, help="running sequences (floor)")
    parser.add_argument("--json", default=None, help="also write results to this file")
    parser.add_argument(
        "--reuse-json", default=None, help="show results of systems not in --only from this file"
    )
    return parser.parse_args(argv)


def _parse_only(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(set(names) - set(SYSTEM_NAMES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown systems {unknown} in --only {text!r}; choose from {','.join(SYSTEM_NAMES)}"
        )
    return names


def _system(name: str, args: argparse.Namespace) -> RunSystem:
    if name == "hf-static":
        return functools.partial(run_hf_static, batch_size=args.static_batch_size)
    if name == "hf-cb":
        return functools.partial(run_hf_continuous, max_batch_tokens=args.token_budget)
    assert name == "pdserve", f"unhandled system {name!r}"
    return run_pdserve


def load_workload(num_requests: int, max_output: int | None, seed: int) -> list[WorkloadItem]:
    tokenize = load_tokenize(default_model_file())
    workload = build_workload(tokenize, WorkloadSpec(num_requests=num_requests, seed=seed))
    return workload if max_output is None else cap_output_tokens(workload, max_output)


def _describe_workload(workload: Sequence[WorkloadItem], seed: int) -> str:
    prompts = [len(p) for p, _ in workload]
    outputs = [o for _, o in workload]
    return (
        f"workload: {len(workload)} requests (seed {seed}), prompt tokens {sum(prompts)} "
        f"({min(prompts)}..{max(prompts)}), output tokens {sum(outputs)} "
        f"({min(outputs)}..{max(outputs)}), EOS ignored"
    )


def _run_isolated(
    run: RunSystem, workload: Sequence[WorkloadItem], dtype: str, name: str
) -> RunResult | str:
    """One system in a fresh process; a system that is not wired yet becomes a note."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        try:
            return pool.submit(run, list(workload), dtype).result()
        except NotImplementedError as err:
            return f"not run ({name}: {err})"


def compute_floor(
    workload: Sequence[WorkloadItem],
    dtype: str,
    token_budget: int,
    max_seqs: int,
    readings: Sequence[Roofline],
) -> FloorResult:
    """The best of the roofline ``readings`` applied to the ideal schedule of ``workload``."""
    roofline = best_reading(readings)
    steps = simulate_schedule([(len(p), o) for p, o in workload], token_budget, max_seqs)
    wall_s = floor_s(steps, ModelShape(), roofline, torch_dtype(dtype).itemsize)
    return FloorResult(roofline, tuple(readings), len(steps), wall_s, sum(o for _, o in workload))


def format_table(results: dict[str, RunResult | str], floor: FloorResult, dtype: str) -> str:
    """The comparison table: one row per system, then the floor."""
    header = (
        f"{'system':<10} {'prompt_tok':>10} {'output_tok':>10} {'wall_s':>9} "
        f"{'out_tok/s':>10} {'peak_MiB':>9} {'x hf-static':>11} {'x hf-cb':>8}"
    )
    lines = [f"dtype {dtype}", header, "-" * len(header)]
    lines += [_format_row(name, result, results) for name, result in results.items()]
    lines.append(_format_floor_row(floor, results))
    lines.append(f"floor: {floor.num_steps} ideal steps at {_describe(floor.roofline)} ({dtype})")
    taken = ("before the runs", "after them")
    lines += [
        f"  roofline read {when}: {_describe(reading)}"
        for when, reading in zip(taken, floor.readings, strict=False)
    ]
    ours = results.get("pdserve")
    if isinstance(ours, RunResult):
        lines.append(f"pdserve wall / floor: {ours.wall_s / floor.wall_s:.2f}x")
    return "\n".join(lines)


def _describe(roof: Roofline) -> str:
    return f"memory {roof.memory_bandwidth_gb_s:.1f} GB/s, matmul {roof.matmul_gflop_s:.0f} GFLOP/s"


def _format_row(name: str, result: RunResult | str, results: dict[str, RunResult | str]) -> str:
    if isinstance(result, str):
        return f"{name:<10} {result}"
    return (
        f"{name:<10} {result.prompt_tokens:>10} {result.output_tokens:>10} "
        f"{result.wall_s:>9.2f} {result.output_tokens_per_s:>10.2f} "
        f"{result.peak_rss_bytes / 2**20:>9.0f} {_ratios(result.output_tokens_per_s, results)}"
    )


def _format_floor_row(floor: FloorResult, results: dict[str, RunResult | str]) -> str:
    rate = floor.output_tokens_per_s
    return (
        f"{'floor':<10} {'':>10} {floor.output_tokens:>10} {floor.wall_s:>9.2f} "
        f"{rate:>10.2f} {'':>9} {_ratios(rate, results)}"
    )


def _ratios(tokens_per_s: float, results: dict[str, RunResult | str]) -> str:
    cells = []
    for baseline, width in zip(BASELINES, (11, 8), strict=True):
        base = results.get(baseline)
        text = "-"
        if isinstance(base, RunResult) and base.output_tokens_per_s > 0:
            text = f"{tokens_per_s / base.output_tokens_per_s:.2f}x"
        cells.append(f"{text:>{width}}")
    return " ".join(cells)


def _write_json(
    path: str, results: dict[str, RunResult | str], floor: FloorResult, args: argparse.Namespace
) -> None:
    payload = {
        "dtype": args.dtype,
        "num_requests": args.num_requests,
        "max_output": args.max_output,
        "seed": args.seed,
        "results": {k: v if isinstance(v, str) else asdict(v) for k, v in results.items()},
        "floor": {**asdict(floor), "output_tokens_per_s": floor.output_tokens_per_s},
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)


if __name__ == "__main__":
    main()
