"""The no-stall benchmark's pure parts (bench/no_stall_report.py) and its process helpers
(bench/up_process.py): workload schedule, setups, window arithmetic, statistics, report."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from pdserve.bench.no_stall import build_parser
from pdserve.bench.no_stall_report import (
    SetupResult,
    Workload,
    format_table,
    latency_stats,
    p99_ratio,
    report_to_dict,
    setup_up_args,
    summarize_setup,
    token_times_s,
    window_gaps_s,
    window_tokens,
)
from pdserve.bench.serve.outputs import RequestOutput
from pdserve.bench.up_process import alive, descendants, process_cores
from pdserve.cluster.cpu_affinity import core_for_worker, parse_cpu_affinity


def output(
    sent_s: float, ttft_s: float, itl_s: tuple[float, ...], ok: bool = True
) -> RequestOutput:
    e2e_s = ttft_s + sum(itl_s) if not math.isnan(ttft_s) else 1.0
    tokens = len(itl_s) + (0 if math.isnan(ttft_s) else 1)
    return RequestOutput(ok, 8, tokens, ttft_s, itl_s, e2e_s, sent_s, error="" if ok else "boom")


def test_long_prompts_arrive_every_period_inside_the_window() -> None:
    w = Workload(long_every_s=3.0, duration_s=10.0, warmup_s=5.0)
    assert w.long_offsets_s() == [5.0, 8.0, 11.0, 14.0]
    assert w.window_s == (5.0, 15.0)
    # a period that divides the window exactly: no prompt at its very end
    assert Workload(long_every_s=2.0, duration_s=6.0, warmup_s=0.0).long_offsets_s() == [
        0.0,
        2.0,
        4.0,
    ]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("streams", 0, "--streams"),
        ("long_tokens", 0, "--long-tokens"),
        ("long_every_s", 0.0, "--long-every-s"),
        ("duration_s", -1.0, "--duration-s"),
        ("warmup_s", -0.5, "--warmup-s"),
    ],
)
def test_workload_refuses_bad_values(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Workload(**{field: value})  # type: ignore[arg-type]


def test_workload_from_the_command_line() -> None:
    args = build_parser().parse_args(["--streams", "3", "--long-every-s", "1.5", "--cores", "1,1"])
    w = Workload.from_args(args)
    assert (w.streams, w.long_every_s, w.long_tokens) == (3, 1.5, 2048)
    assert args.cores == (1, 1)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--cores", "1"])


def test_request_sources_are_seeded_and_distinct() -> None:
    w = Workload(seed=7)
    assert w.rng("stream-0").random() == w.rng("stream-0").random()
    assert w.rng("stream-0").random() != w.rng("stream-1").random()
    assert w.rng("long-0").random() != Workload(seed=8).rng("long-0").random()


def test_setups_pin_each_worker_to_its_own_core() -> None:
    args, env = setup_up_args("disagg", (0, 1), 640, None)
    spec = parse_cpu_affinity(args[args.index("--cpu-affinity") + 1])
    assert core_for_worker(spec, "prefill", "prefill-0") == 0
    assert core_for_worker(spec, "decode", "decode-0") == 1
    assert args[:4] == ["--prefill", "1", "--decode", "1"]
    assert env["PDSERVE_TORCH_THREADS"] == "1"

    args, _ = setup_up_args("colocated", (0, 1), 640, "round_robin", ["--max-num-batched-tokens"])
    spec = parse_cpu_affinity(args[args.index("--cpu-affinity") + 1])
    cores = [core_for_worker(spec, "colocated", f"colocated-{slot}") for slot in (0, 1)]
    assert cores == [0, 1]
    assert "--colocated" in args and "--prefill" not in args
    assert args[args.index("--policy") + 1] == "round_robin"
    assert "--worker-arg=--max-num-batched-tokens" in args
    with pytest.raises(ValueError, match="setup must be one of"):
        setup_up_args("mixed", (0, 1), 640, None)


def test_token_times_rebuild_arrivals_from_ttft_and_gaps() -> None:
    out = output(sent_s=100.0, ttft_s=0.5, itl_s=(0.1, 0.2, 0.3))
    assert token_times_s(out) == pytest.approx([100.5, 100.6, 100.8, 101.1])
    assert token_times_s(output(100.0, math.nan, ())) == []


def test_only_gaps_ending_inside_the_window_count() -> None:
    # tokens at 10.0, 11.0, 13.0, 16.0 -> gaps 1 (ends 11), 2 (ends 13), 3 (ends 16)
    a = output(sent_s=9.0, ttft_s=1.0, itl_s=(1.0, 2.0, 3.0))
    failed = output(sent_s=9.0, ttft_s=1.0, itl_s=(5.0,), ok=False)
    assert window_gaps_s([a, failed], 10.5, 16.0) == [1.0, 2.0]  # 16.0 is past the end
    assert window_gaps_s([a], 11.0, 20.0) == [1.0, 2.0, 3.0]  # a gap may start before it
    assert window_tokens([a, failed], 10.0, 13.0) == 2  # 10.0 and 11.0
    assert window_gaps_s([a], 20.0, 30.0) == []


def test_latency_stats_match_numpy_percentiles() -> None:
    rng = np.random.default_rng(3)
    values_s = list(rng.exponential(0.05, size=501))
    stats = latency_stats(values_s)
    ms = np.array(values_s) * 1000
    assert stats.count == 501
    assert stats.p50_ms == pytest.approx(np.percentile(ms, 50))
    assert stats.p99_ms == pytest.approx(np.percentile(ms, 99))
    assert stats.p999_ms == pytest.approx(np.percentile(ms, 99.9))
    assert stats.max_ms == pytest.approx(ms.max())
    assert latency_stats([]).p99_ms is None


def _result(setup: str, p99_ms: float | None) -> SetupResult:
    stats = latency_stats([] if p99_ms is None else [p99_ms / 1000.0])
    return SetupResult(setup, stats, latency_stats([2.0]), 100.0, 10, 0, 3, 0, (2000.0,), ())


def test_summarize_setup_uses_the_window_and_counts_failures() -> None:
    w = Workload(duration_s=4.0, warmup_s=1.0)
    streams = [output(0.0, 0.5, (0.25,) * 20), output(0.0, math.nan, (), ok=False)]
    longs = [output(2.0, 1.5, (0.1,)), output(2.0, math.nan, (), ok=False)]
    r = summarize_setup("colocated", streams, longs, t0_s=0.0, workload=w)
    # tokens at 0.5, 0.75, ... 5.5: those in [1, 5) are 1.0 .. 4.75 = 16 tokens, 16 gaps
    assert r.itl.count == 16 and r.itl.max_ms == pytest.approx(250.0)
    assert r.stream_tokens_per_s == pytest.approx(16 / 4.0)
    assert (r.stream_requests, r.stream_failed, r.long_sent, r.long_failed) == (2, 1, 2, 1)
    assert r.long_ttfts_ms == (1500.0,)
    assert r.errors == ("boom",)


def test_ratio_table_and_json() -> None:
    results = [_result("disagg", 40.0), _result("colocated", 200.0)]
    assert p99_ratio(results) == pytest.approx(0.2)
    assert p99_ratio(results[:1]) is None
    assert p99_ratio([_result("disagg", 40.0), _result("colocated", None)]) is None
    table = format_table(results, 0.5)
    assert "0.200 (target <= 0.5: met)" in table
    assert "NOT met" in format_table([_result("disagg", 150.0), results[1]], 0.5)
    record = report_to_dict(results, Workload(), (0, 1), 0.5)
    text = json.dumps(record, allow_nan=False)  # strict JSON: no NaN anywhere
    back = json.loads(text)
    assert back["meets_target"] is True
    assert back["setups"]["colocated"]["itl"]["p99_ms"] == pytest.approx(200.0)
    assert back["setups"]["disagg"]["workers"] == "1P+1D pinned"


def test_descendants_lists_a_child_and_alive_sees_it_end() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        found = descendants_of_self_until(child.pid)
        assert child.pid in found
        assert alive(child.pid, found[child.pid])
        assert not alive(child.pid, "some other command")  # a reused pid is not ours
        cores = process_cores(os.getpid(), found[child.pid][:20])
        assert cores[child.pid] == sorted(os.sched_getaffinity(0))  # inherited from us
        assert process_cores(os.getpid(), "no such command") == {}
    finally:
        child.kill()
        child.wait(10)
    assert not alive(child.pid, found[child.pid])


def descendants_of_self_until(pid: int, timeout_s: float = 5.0) -> dict[int, str]:
    """descendants() of this process once ``pid`` shows its command line (after exec)."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        found = descendants(os.getpid())
        if "time.sleep" in found.get(pid, "") or time.monotonic() > deadline_s:
            return found
        time.sleep(0.01)


def test_build_parser_defaults_are_the_issue_workload() -> None:
    args = build_parser().parse_args([])
    assert isinstance(args, argparse.Namespace)
    w = Workload.from_args(args)
    assert (w.streams, w.long_tokens, w.long_every_s) == (8, 2048, 3.0)
    assert args.cores == (0, 1) and args.target_ratio == 0.5
