"""Side-by-side benchmark comparisons (bench/serve/compare.py) and the pure parts of the
goodput / shared-prefix sweep (bench/goodput_sweep.py). Expected tables are worked out by
hand from the figures below; pinning is checked on real child processes."""

from __future__ import annotations

import ast
import functools
import math
import os
import struct
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from pdserve.bench.goodput_sweep import (
    ClusterSetup,
    affinity_flags,
    check_pinned,
    goodput_setups,
    prefix_setups,
)
from pdserve.bench.serve.compare import (
    goodput_table,
    plot_goodput_vs_rate,
    plot_prefix_routing,
    prefix_table,
    slo_text,
    sustainable_rate,
)
from pdserve.bench.serve.config import BenchConfig, BenchResult, RateResult
from pdserve.bench.serve.metrics import SLO, Distribution, Summary
from pdserve.bench.serve.server_metrics import ServerFigures
from pdserve.cluster.cpu_affinity import core_for_worker, parse_cpu_affinity

NAN = math.nan
GOODPUT_SLO = SLO(ttft_ms=1000.0, tpot_ms=75.0)
BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def _dist(p50_ms: float, p90_ms: float) -> Distribution:
    return Distribution(count=1, mean_ms=p50_ms, std_ms=0.0, p50_ms=p50_ms, p90_ms=p90_ms,
                        p99_ms=p90_ms)  # fmt: skip


def _run(
    rate: float,
    ok_failed: tuple[int, int],
    throughput: float,
    goodput: float | None = None,
    attained: float | None = None,
    ttft_ms: tuple[float, float] = (NAN, NAN),
    tpot_ms: tuple[float, float] = (NAN, NAN),
    e2e_p50_ms: float = NAN,
    server: ServerFigures | None = None,
) -> RateResult:
    """One run with only the figures the comparisons read; the rest are placeholders."""
    summary = Summary(
        completed=ok_failed[0], failed=ok_failed[1], duration_s=10.0, input_tokens=0,
        output_tokens=0, request_throughput=throughput, output_throughput=0.0,
        total_token_throughput=0.0, goodput=goodput, slo_attainment=attained,
        ttft=_dist(*ttft_ms), tpot=_dist(*tpot_ms), itl=_dist(NAN, NAN),
        e2el=_dist(e2e_p50_ms, NAN),
    )  # fmt: skip
    return RateResult(rate, summary, server or ServerFigures(), outputs=())


def _result(runs: Sequence[RateResult], slo: SLO = GOODPUT_SLO) -> BenchResult:
    rates = tuple(run.request_rate for run in runs)
    return BenchResult(BenchConfig(request_rates=rates, slo=slo), "smollm2", tuple(runs))


def _attainment_only(*rate_attained: tuple[float, float | None]) -> BenchResult:
    return _result([_run(rate, (1, 0), 1.0, attained=a) for rate, a in rate_attained])


# --- slo_text, sustainable_rate ---------------------------------------------------------


@pytest.mark.parametrize(
    ("slo", "text"),
    [
        (SLO(ttft_ms=1000.0, tpot_ms=75.0), "TTFT <= 1000 ms, TPOT <= 75 ms"),
        (SLO(ttft_ms=200.0, e2el_ms=3000.0), "TTFT <= 200 ms, E2E <= 3000 ms"),
        (SLO(tpot_ms=12.5), "TPOT <= 12.5 ms"),
        (SLO(), "no SLO"),
    ],
)
def test_slo_text_names_only_the_targets_set(slo: SLO, text: str) -> None:
    assert slo_text(slo) == text


def test_sustainable_rate_is_the_highest_rate_meeting_the_attainment() -> None:
    # not the first miss: 4 req/s met it again after 3 req/s did not
    result = _attainment_only((1.0, 1.0), (2.0, 0.95), (3.0, 0.5), (4.0, 0.92))
    assert sustainable_rate(result) == 4.0
    assert sustainable_rate(result, attainment=0.93) == 2.0
    assert sustainable_rate(result, attainment=0.5) == 4.0


def test_sustainable_rate_counts_exactly_the_target_and_an_unbounded_rate() -> None:
    assert sustainable_rate(_attainment_only((1.0, 0.9), (2.0, 0.89))) == 1.0  # >=, not >
    assert sustainable_rate(_attainment_only((1.0, 1.0), (math.inf, 1.0))) == math.inf


def test_sustainable_rate_is_none_when_no_run_qualifies_or_no_slo_was_set() -> None:
    assert sustainable_rate(_attainment_only((1.0, 0.5), (2.0, 0.1))) is None
    assert sustainable_rate(_attainment_only((1.0, None), (2.0, None))) is None


# --- goodput_table ----------------------------------------------------------------------


def _goodput_series() -> dict[str, BenchResult]:
    disagg = [
        _run(1.0, (20, 0), 0.984, 0.951, 0.95, (120.2, 340.7), (40.4, 61.0)),
        _run(math.inf, (19, 1), 3.456, 1.2, 0.3, (800.0, 2400.0), (70.0, 90.0)),
    ]
    colocated = [
        _run(1.0, (20, 0), 0.99, 0.5, 0.5, (300.0, 900.0)),  # one token each: no TPOT
        _run(math.inf, (0, 20), 0.0, 0.0, 0.0),  # every request failed: no latencies
    ]
    return {"1 prefill + 1 decode": _result(disagg), "2 colocated": _result(colocated)}


def test_goodput_table_rows_go_rate_by_rate_then_setup_by_setup() -> None:
    expected = "\n".join([
        "SLO: TTFT <= 1000 ms, TPOT <= 75 ms",
        "",
        "| rate (req/s) | setup | ok / failed | throughput (req/s) | goodput (req/s) "
        "| SLO met (%) | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) |",
        "|---|---|---|---|---|---|---|---|",
        "| 1 | 1 prefill + 1 decode | 20 / 0 | 0.98 | 0.95 | 95 | 120 / 341 | 40 / 61 |",
        "| 1 | 2 colocated | 20 / 0 | 0.99 | 0.50 | 50 | 300 / 900 | n/a / n/a |",
        "| inf | 1 prefill + 1 decode | 19 / 1 | 3.46 | 1.20 | 30 | 800 / 2400 | 70 / 90 |",
        "| inf | 2 colocated | 0 / 20 | 0.00 | 0.00 | 0 | n/a / n/a | n/a / n/a |",
        "",
        "- 1 prefill + 1 decode: highest rate with >= 90% of requests within SLO: 1.000 req/s",
        "- 2 colocated: no rate had >= 90% of requests within SLO",
    ])  # fmt: skip
    assert goodput_table(_goodput_series()) == expected


def test_goodput_table_refuses_setups_that_ran_different_rate_counts() -> None:
    series = _goodput_series()
    series["short"] = _result([_run(1.0, (1, 0), 1.0, 1.0, 1.0)])
    with pytest.raises(ValueError, match="same rates"):
        goodput_table(series)
    with pytest.raises(ValueError, match="nothing to compare"):
        goodput_table({})


# --- prefix_table -----------------------------------------------------------------------


def _prefix_series() -> dict[str, BenchResult]:
    round_robin = _run(
        0.5,
        (64, 0),
        0.48,
        ttft_ms=(400.0, 900.0),
        e2e_p50_ms=2000.0,
        server=ServerFigures(prefix_hit_tokens=250.0, prompt_tokens=1000.0),
    )
    prefix_aware = _run(
        0.5,
        (64, 0),
        0.5,
        ttft_ms=(150.0, 300.0),
        e2e_p50_ms=1500.0,
        server=ServerFigures(prefix_hit_tokens=750.0, prompt_tokens=1000.0),
    )
    # a server without the prefix counters
    least_loaded = _run(0.5, (63, 1), 0.47, ttft_ms=(400.0, 450.0), e2e_p50_ms=1800.0)
    return {
        "round_robin": _result([round_robin], SLO()),
        "prefix_aware": _result([prefix_aware], SLO()),
        "least_loaded": _result([least_loaded], SLO()),
    }  # fmt: skip


def test_prefix_table_lists_policies_and_ratios_against_the_first() -> None:
    expected = "\n".join([
        "| policy | ok / failed | prefix-hit rate (%) | TTFT p50 (ms) | TTFT p90 (ms) "
        "| E2E p50 (ms) | throughput (req/s) |",
        "|---|---|---|---|---|---|---|",
        "| round_robin | 64 / 0 | 25.0 | 400 | 900 | 2000 | 0.48 |",
        "| prefix_aware | 64 / 0 | 75.0 | 150 | 300 | 1500 | 0.50 |",
        "| least_loaded | 63 / 1 | n/a | 400 | 450 | 1800 | 0.47 |",
        "",
        # 75 % / 25 % hits = 3x; 900 ms / 300 ms TTFT p90 = 3x; 900 / 450 = 2x
        "- prefix_aware vs round_robin: prefix-hit rate 3.00x, TTFT p90 3.00x better",
        "- least_loaded vs round_robin: prefix-hit rate n/a, TTFT p90 2.00x better",
    ])  # fmt: skip
    assert prefix_table(_prefix_series()) == expected


def test_prefix_ratios_over_a_zero_or_a_missing_figure() -> None:
    cold = _result([_run(0.5, (8, 0), 0.5, ttft_ms=(100.0, 200.0),
                         server=ServerFigures(0.0, 1000.0))], SLO())  # fmt: skip
    warm = _result([_run(0.5, (8, 0), 0.5, ttft_ms=(50.0, 100.0),
                         server=ServerFigures(500.0, 1000.0))], SLO())  # fmt: skip
    failed = _result([_run(0.5, (0, 8), 0.0, server=ServerFigures(0.0, 0.0))], SLO())
    table = prefix_table({"round_robin": cold, "prefix_aware": warm, "broken": failed})
    lines = table.splitlines()
    assert lines[-2] == "- prefix_aware vs round_robin: prefix-hit rate inf, TTFT p90 2.00x better"
    # no successful request: no TTFT to compare (not "infinitely better")
    assert lines[-1] == "- broken vs round_robin: prefix-hit rate n/a, TTFT p90 n/a better"
    with pytest.raises(ValueError, match="nothing to compare"):
        prefix_table({})


# --- plots ------------------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, which must come first in a PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG: starts {data[:8]!r}"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plot_goodput_vs_rate_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "img" / "goodput.png"  # the folder does not exist yet
    assert plot_goodput_vs_rate(_goodput_series(), path) == path
    assert _png_size(path) == (1200, 450)  # figsize 12 x 4.5 in at 100 dpi


def test_plot_prefix_routing_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "prefix.png"
    assert plot_prefix_routing(_prefix_series(), path) == path
    assert _png_size(path) == (1100, 450)  # figsize 11 x 4.5 in at 100 dpi


# --- goodput_sweep: setups and flags ----------------------------------------------------


def test_goodput_setups_put_both_clusters_on_the_same_two_cores() -> None:
    disagg, colocated = goodput_setups((2, 5), ["disagg", "colocated"])
    assert disagg == ClusterSetup(
        "1 prefill + 1 decode", ("--prefill", "1", "--decode", "1"),
        {"prefill": (2,), "decode": (5,)},
    )  # fmt: skip
    assert colocated == ClusterSetup("2 colocated", ("--colocated", "2"), {"colocated": (2, 5)})
    assert goodput_setups((0, 1), ["colocated"])[0].label == "2 colocated"  # order as asked


def test_goodput_setups_reject_an_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"unknown \['two_pools'\]"):
        goodput_setups((0, 1), ["disagg", "two_pools"])


def test_prefix_setups_normalize_policy_names_and_pin_nothing() -> None:
    setups = prefix_setups(["Round-Robin", " prefix_aware"])
    assert [s.label for s in setups] == ["round_robin", "prefix_aware"]
    assert setups[1].up_args == ("--prefill", "2", "--decode", "1", "--policy", "prefix_aware")
    assert all(s.cores == {} for s in setups)
    with pytest.raises(ValueError, match="routing_policy"):
        prefix_setups(["round_robin", "random"])


def test_affinity_flags_are_what_pdserve_up_parses() -> None:
    assert affinity_flags({}) == ()
    flag, spec = affinity_flags({"prefill": (0,), "decode": (1,)})
    assert (flag, spec) == ("--cpu-affinity", "prefill=0;decode=1")
    assert parse_cpu_affinity(spec) == (("prefill", (0,)), ("decode", (1,)))
    (_, spec) = affinity_flags(goodput_setups((0, 1), ["colocated"])[0].cores)
    assert spec == "colocated=0,1"
    # pdserve up puts worker colocated-<i> on the i-th core: the order check_pinned expects
    pools = parse_cpu_affinity(spec)
    assert [core_for_worker(pools, "colocated", f"colocated-{i}") for i in (0, 1)] == [0, 1]


# --- goodput_sweep: check_pinned on real processes --------------------------------------


@pytest.fixture
def pinned_sleepers() -> Iterator[list[int]]:
    """Two idle child processes: the first pinned to core 1, the second to core 0."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two CPU cores")
    children: list[subprocess.Popen[bytes]] = []
    try:
        for core in (1, 0):  # the child pins itself before exec; sleep inherits it
            pin = functools.partial(os.sched_setaffinity, 0, {core})
            children.append(subprocess.Popen(["sleep", "60"], preexec_fn=pin))
        yield [child.pid for child in children]
    finally:
        for child in children:
            child.kill()
            child.wait(10)


def _row(role: str, worker_id: str, pid: int) -> dict[str, object]:
    return {"role": role, "worker_id": worker_id, "pid": pid}


def test_check_pinned_matches_cores_in_worker_id_order(pinned_sleepers: list[int]) -> None:
    on_1, on_0 = pinned_sleepers
    # listed out of order: check_pinned sorts by worker id before pairing with cores
    rows = [_row("colocated", "colocated-1", on_0), _row("colocated", "colocated-0", on_1)]
    check_pinned(rows, {"colocated": (1, 0)})
    with pytest.raises(RuntimeError, match="colocated-0 should run on core 0"):
        check_pinned(rows, {"colocated": (0, 1)})


def test_check_pinned_ignores_unpinned_pools_and_counts_pinned_ones(
    pinned_sleepers: list[int],
) -> None:
    on_1, _ = pinned_sleepers
    rows = [_row("prefill", "prefill-0", on_1), _row("decode", "decode-0", os.getpid())]
    check_pinned(rows, {"prefill": (1,)})  # decode is not pinned: its core is not checked
    check_pinned(rows, {})
    with pytest.raises(ValueError, match=r"1 prefill worker\(s\) up but cores given: \(1, 0\)"):
        check_pinned(rows, {"prefill": (1, 0)})
    with pytest.raises(ValueError, match="0 colocated worker"):
        check_pinned(rows, {"colocated": (0,)})


# --- bench/ stays free of tests/ --------------------------------------------------------


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_bench_imports_nothing_from_tests() -> None:
    offenders = {
        str(path.relative_to(BENCH_DIR.parent)): sorted(
            name for name in _imported_modules(path) if name.split(".")[0] == "tests"
        )
        for path in sorted(BENCH_DIR.rglob("*.py"))
    }
    assert {path: names for path, names in offenders.items() if names} == {}
