"""The no-stall benchmark's pure parts: workload, the two setups, window arithmetic, report.

See bench/no_stall.py for the method. Nothing here does I/O or starts anything.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.bench.serve.metrics import percentile
from pdserve.bench.serve.outputs import RequestOutput

SETUPS = ("disagg", "colocated")
SETUP_LABELS = {"disagg": "1P+1D pinned", "colocated": "2 colocated"}
MAX_ERRORS_KEPT = 3


@dataclass(slots=True, frozen=True)
class Workload:
    """K steady streams all along; a long prompt every ``long_every_s`` in the window."""

    streams: int = 8
    stream_prompt_tokens: int = 32
    stream_output_tokens: int = 256
    long_tokens: int = 2048
    long_output_tokens: int = 16
    long_every_s: float = 3.0
    duration_s: float = 60.0
    warmup_s: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        counts = {
            "streams": self.streams,
            "stream-prompt-tokens": self.stream_prompt_tokens,
            "stream-output-tokens": self.stream_output_tokens,
            "long-tokens": self.long_tokens,
            "long-output-tokens": self.long_output_tokens,
        }
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}")
        if not (self.long_every_s > 0 and self.duration_s > 0 and self.warmup_s >= 0):
            raise ValueError(
                f"need --long-every-s > 0, --duration-s > 0 and --warmup-s >= 0, got "
                f"{self.long_every_s}, {self.duration_s}, {self.warmup_s}"
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Workload:
        names = [f for f in cls.__dataclass_fields__ if hasattr(args, f)]
        return cls(**{name: getattr(args, name) for name in names})

    @property
    def window_s(self) -> tuple[float, float]:
        """The measured window, in seconds after t0."""
        return self.warmup_s, self.warmup_s + self.duration_s

    def long_offsets_s(self) -> list[float]:
        """When the long prompts are sent, in seconds after t0: every period in the window."""
        count = math.ceil(self.duration_s / self.long_every_s - 1e-9)
        return [self.warmup_s + i * self.long_every_s for i in range(count)]

    def rng(self, name: str) -> random.Random:
        """A generator of its own per request source, so streams do not share prompts."""
        return random.Random(f"{self.seed}:{name}")


def setup_up_args(
    setup: str,
    cores: tuple[int, int],
    num_blocks: int,
    policy: str | None,
    worker_args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """`pdserve up` flags and environment of a setup: worker pools, pinning, 1 torch thread."""
    a, b = cores
    if setup == "disagg":
        args = ["--prefill", "1", "--decode", "1", "--cpu-affinity", f"prefill={a};decode={b}"]
    elif setup == "colocated":
        args = ["--colocated", "2", "--cpu-affinity", f"colocated={a},{b}"]
    else:
        raise ValueError(f"setup must be one of {SETUPS}, got {setup!r}")
    args += ["--num-blocks", str(num_blocks)]
    args += ["--policy", policy] if policy else []
    for worker_arg in worker_args:
        args.append(f"--worker-arg={worker_arg}")  # '=': the value may start with '--'
    return args, {"PDSERVE_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}


def token_times_s(out: RequestOutput) -> list[float]:
    """When each token event of ``out`` arrived (perf_counter clock); [] if none did."""
    if math.isnan(out.ttft_s):
        return []
    return list(itertools.accumulate(out.itl_s, initial=out.sent_at_s + out.ttft_s))


def window_gaps_s(outputs: Sequence[RequestOutput], start_s: float, end_s: float) -> list[float]:
    """Inter-token gaps of successful requests whose later token arrived in [start, end)."""
    gaps = []
    for out in outputs:
        if not out.success:
            continue
        times = token_times_s(out)
        gaps += [gap for gap, t in zip(out.itl_s, times[1:], strict=True) if start_s <= t < end_s]
    return gaps


def window_tokens(outputs: Sequence[RequestOutput], start_s: float, end_s: float) -> int:
    """Token events of successful requests that arrived in [start, end)."""
    return sum(start_s <= t < end_s for out in outputs if out.success for t in token_times_s(out))


@dataclass(slots=True, frozen=True)
class LatencyStats:
    """Percentiles of latencies in ms (None without samples); linear interpolation."""

    count: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    p999_ms: float | None
    max_ms: float | None


def latency_stats(values_s: Sequence[float]) -> LatencyStats:
    if not values_s:
        return LatencyStats(0, None, None, None, None, None)
    ms = [v * 1000.0 for v in values_s]
    p50, p90, p99, p999 = (percentile(ms, q) for q in (50, 90, 99, 99.9))
    return LatencyStats(len(ms), p50, p90, p99, p999, max(ms))


@dataclass(slots=True, frozen=True)
class SetupResult:
    """What one setup did in the measured window."""

    setup: str
    itl: LatencyStats  # steady streams' inter-token gaps
    long_ttft: LatencyStats  # the long prompts' time to first token
    stream_tokens_per_s: float  # steady streams' token events per second of the window
    stream_requests: int
    stream_failed: int
    long_sent: int
    long_failed: int
    long_ttfts_ms: tuple[float, ...]
    errors: tuple[str, ...]  # the first few distinct failure reasons
    worker_cores: tuple[str, ...] = ()  # 'pid: cores' of each worker process, as seen


def summarize_setup(
    setup: str,
    stream_outputs: Sequence[RequestOutput],
    long_outputs: Sequence[RequestOutput],
    t0_s: float,
    workload: Workload,
) -> SetupResult:
    start_s, end_s = (t0_s + w for w in workload.window_s)
    long_ok = [o for o in long_outputs if o.success]
    failed = [o for o in (*stream_outputs, *long_outputs) if not o.success]
    return SetupResult(
        setup=setup,
        itl=latency_stats(window_gaps_s(stream_outputs, start_s, end_s)),
        long_ttft=latency_stats([o.ttft_s for o in long_ok]),
        stream_tokens_per_s=window_tokens(stream_outputs, start_s, end_s) / workload.duration_s,
        stream_requests=len(stream_outputs),
        stream_failed=sum(not o.success for o in stream_outputs),
        long_sent=len(long_outputs),
        long_failed=len(long_outputs) - len(long_ok),
        long_ttfts_ms=tuple(round(o.ttft_s * 1000.0, 3) for o in long_ok),
        errors=tuple(dict.fromkeys(o.error for o in failed))[:MAX_ERRORS_KEPT],
    )


def p99_ratio(results: Sequence[SetupResult]) -> float | None:
    """p99 ITL of disagg / p99 ITL of colocated; None unless both were measured."""
    by_setup = {r.setup: r.itl.p99_ms for r in results}
    disagg, colocated = by_setup.get("disagg"), by_setup.get("colocated")
    if disagg is None or not colocated:
        return None
    return disagg / colocated


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def format_table(results: Sequence[SetupResult], target_ratio: float) -> str:
    header = (
        f"{'setup':<10} {'workers':<13} {'ITL p50':>8} {'p90':>7} {'p99':>7} {'p99.9':>7} "
        f"{'max':>7} {'gaps':>6} {'TTFT p50':>9} {'p90':>7} {'max':>7} {'long':>5} "
        f"{'tok/s':>6} {'failed':>6}"
    )
    lines = [header]
    for r in results:
        i, t = r.itl, r.long_ttft
        lines.append(
            f"{r.setup:<10} {SETUP_LABELS[r.setup]:<13} {_ms(i.p50_ms):>8} {_ms(i.p90_ms):>7} "
            f"{_ms(i.p99_ms):>7} {_ms(i.p999_ms):>7} {_ms(i.max_ms):>7} {i.count:>6} "
            f"{_ms(t.p50_ms):>9} {_ms(t.p90_ms):>7} {_ms(t.max_ms):>7} {r.long_sent:>5} "
            f"{r.stream_tokens_per_s:>6.1f} {r.stream_failed + r.long_failed:>6}"
        )
    lines.append("(ms; ITL of the steady streams, TTFT of the long prompts; tok/s: streams)")
    ratio = p99_ratio(results)
    if ratio is not None:
        verdict = "met" if ratio <= target_ratio else "NOT met"
        lines.append(
            f"p99 ITL ratio disagg/colocated: {ratio:.3f} (target <= {target_ratio}: {verdict})"
        )
    for r in results:
        lines += [f"{r.setup} error: {e}" for e in r.errors]
    return "\n".join(lines)


def report_to_dict(
    results: Sequence[SetupResult],
    workload: Workload,
    cores: tuple[int, int],
    target_ratio: float,
) -> dict[str, Any]:
    """JSON-ready record (absent figures are null)."""
    ratio = p99_ratio(results)
    return {
        "workload": asdict(workload),
        "cores": list(cores),
        "setups": {r.setup: {"workers": SETUP_LABELS[r.setup], **asdict(r)} for r in results},
        "p99_ratio": ratio,
        "target_ratio": target_ratio,
        "meets_target": None if ratio is None else ratio <= target_ratio,
    }
