"""The printed result table (laid out like ``vllm bench serve``'s) and the JSON record."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from pdserve.bench.serve.config import BenchConfig, BenchResult, RateResult
from pdserve.bench.serve.metrics import Distribution
from pdserve.bench.serve.outputs import RequestOutput

WIDTH = 50
LABEL_WIDTH = 40
NA = "n/a"

_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def format_run(result: BenchResult, run: RateResult) -> str:
    """One run's result table."""
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]
    lines += [_row(label, value) for label, value in _headline(result, run)]
    for attr, short, title in _SECTIONS:
        lines.append(f" {title} ".center(WIDTH, "-"))
        lines += _distribution_rows(short, getattr(run.summary, attr))
    lines.append(" Server (from /metrics) ".center(WIDTH, "-"))
    lines += [_row(label, value) for label, value in _server_rows(run)]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _headline(result: BenchResult, run: RateResult) -> list[tuple[str, Any]]:
    config, s = result.config, run.summary
    rows: list[tuple[str, Any]] = [
        ("Backend:", config.backend),
        ("Model:", result.model),
        ("Dataset:", config.dataset.name),
        ("Request rate (req/s):", f"{run.request_rate:g}"),
        ("Max concurrency:", config.max_concurrency or "none"),
        ("Successful requests:", s.completed),
        ("Failed requests:", s.failed),
        ("Benchmark duration (s):", s.duration_s),
        ("Total input tokens:", s.input_tokens),
        ("Total generated tokens:", s.output_tokens),
        ("Request throughput (req/s):", s.request_throughput),
        ("Output token throughput (tok/s):", s.output_throughput),
        ("Total token throughput (tok/s):", s.total_token_throughput),
    ]
    if s.goodput is not None:
        rows.append(("Request goodput (req/s):", s.goodput))
        attainment = s.slo_attainment
        rows.append(("SLO attainment (%):", None if attainment is None else attainment * 100))
    return rows


def _distribution_rows(short: str, dist: Distribution) -> list[str]:
    return [
        _row(f"Mean {short} (ms):", dist.mean_ms),
        _row(f"Std {short} (ms):", dist.std_ms),
        _row(f"P50 {short} (ms):", dist.p50_ms),
        _row(f"P90 {short} (ms):", dist.p90_ms),
        _row(f"P99 {short} (ms):", dist.p99_ms),
    ]


def _server_rows(run: RateResult) -> list[tuple[str, Any]]:
    server = run.server
    hit_rate = server.prefix_hit_rate
    rate_bps = server.kv_transfer_bytes_per_s
    return [
        ("Prefix cache hit rate (%):", None if hit_rate is None else hit_rate * 100),
        ("Prompt tokens (server):", server.prompt_tokens),
        ("Prefix-cache hit tokens:", server.prefix_hit_tokens),
        (
            "KV transfer (MB):",
            None if server.kv_transfer_bytes is None else server.kv_transfer_bytes / 1e6,
        ),
        ("KV transfer time (s):", server.kv_transfer_s),
        ("KV transfer rate (MB/s):", None if rate_bps is None else rate_bps / 1e6),
    ]


def _row(label: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        text = NA
    elif isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = str(value)
    return f"{label:<{LABEL_WIDTH}}{text}"


def result_to_dict(result: BenchResult) -> dict[str, Any]:
    """Everything about the benchmark as JSON-ready data (nan -> null, inf -> "inf")."""
    return _clean(
        {
            "model": result.model,
            "config": config_to_dict(result.config),
            "warmup_failed_requests": result.warmup_failed,
            "runs": [_run_to_dict(run) for run in result.runs],
        }
    )


def config_to_dict(config: BenchConfig) -> dict[str, Any]:
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields.pop("corpus")  # the prompt text itself; the dataset spec and seed identify it
    fields["tokenizer"] = None if config.tokenizer is None else type(config.tokenizer).__name__
    fields["api_key"] = "***" if config.api_key else None  # never written to disk
    fields["dataset"] = {"name": config.dataset.name, **dataclasses.asdict(config.dataset)}
    fields["slo"] = dataclasses.asdict(config.slo)
    return fields


def _run_to_dict(run: RateResult) -> dict[str, Any]:
    server = dataclasses.asdict(run.server)
    server["prefix_hit_rate"] = run.server.prefix_hit_rate
    server["kv_transfer_bytes_per_s"] = run.server.kv_transfer_bytes_per_s
    return {
        "request_rate": run.request_rate,
        "summary": dataclasses.asdict(run.summary),
        "server": server,
        "requests": [_output_to_dict(o) for o in run.outputs],
    }


def _output_to_dict(out: RequestOutput) -> dict[str, Any]:
    record = dataclasses.asdict(out)
    record.pop("generated_text")  # not a measurement, and large
    record["tpot_s"] = out.tpot_s
    return record


def write_json(result: BenchResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result_to_dict(result), indent=2, allow_nan=False) + "\n")


def _clean(value: Any) -> Any:
    """Strict JSON: nan becomes null and infinities become strings."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value
