"""Command-line options -> BenchConfig, and the validation a user sees."""

from __future__ import annotations

import argparse
import math

import pytest

from pdserve.bench.serve import BenchConfig, MultiTurnSpec, SharedPrefixSpec, add_serve_arguments
from pdserve.bench.serve.cli import config_from_args
from pdserve.bench.serve.metrics import SLO


def _config(*argv: str) -> BenchConfig:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return config_from_args(parser.parse_args(["--tokenizer", "none", *argv]))


def test_defaults() -> None:
    config = _config()
    assert config.dataset.name == "sharegpt-like"
    assert config.request_rates == (math.inf,)
    assert config.tokenizer is None and config.scrape_metrics
    assert config.resolved_metrics_url == "http://127.0.0.1:8000/metrics"
    assert config.slo == SLO() and config.max_concurrency is None


def test_options_reach_the_config() -> None:
    config = _config(
        "--dataset-name", "shared-prefix", "--prefix-groups", "3", "--prefix-len", "100",
        "--question-len", "7", "--prefix-output-len", "9", "--request-rate", "1,2.5",
        "--goodput", "ttft:300", "tpot:40", "--max-concurrency", "16", "--metrics-url", "none",
        "--base-url", "http://h:1/", "--backend", "grpc", "--warmup", "2",
    )  # fmt: skip
    assert config.dataset == SharedPrefixSpec(3, 100, 7, 9)
    assert config.request_rates == (1.0, 2.5)
    assert config.slo == SLO(ttft_ms=300.0, tpot_ms=40.0)
    assert (config.max_concurrency, config.warmup, config.backend) == (16, 2, "grpc")
    assert not config.scrape_metrics


def test_multi_turn_options() -> None:
    config = _config("--dataset-name", "multi-turn", "--turns", "5", "--turn-input-len", "20")
    assert config.dataset == MultiTurnSpec(num_turns=5, turn_input_tokens=20)


@pytest.mark.parametrize(
    "argv",
    [
        ("--num-prompts", "0"),
        ("--max-concurrency", "0"),
        ("--request-rate", "0"),
        ("--goodput", "ttft"),
        ("--random-range-ratio", "1.5", "--dataset-name", "random"),
        ("--warmup", "-1"),
    ],
)
def test_bad_options_raise_value_error(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        _config(*argv)
