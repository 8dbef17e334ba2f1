"""The benchmark's configuration and result types."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.bench.serve.datasets import DatasetSpec, RandomSpec
from pdserve.bench.serve.metrics import SLO, Summary
from pdserve.bench.serve.outputs import RequestOutput
from pdserve.bench.serve.server_metrics import ServerFigures
from pdserve.bench.serve.tokens import TokenizerLike

BACKENDS = ("openai", "grpc")


@dataclass(slots=True, frozen=True)
class BenchConfig:
    """One benchmark invocation: what to send, how fast, to which server.

    Every rate in ``request_rates`` is a separate run with its own draw of the dataset
    (seed + run index), so one rate's requests do not warm the prefix cache for the next.
    ``corpus`` holds prompt-text paragraphs; None means ``bench/data`` (or the built-in word
    list). ``metrics_url`` None means ``<base_url>/metrics``.
    """

    dataset: DatasetSpec = field(default_factory=RandomSpec)
    num_prompts: int = 100  # conversations for multi-turn
    request_rates: tuple[float, ...] = (math.inf,)
    backend: str = "openai"
    base_url: str = "http://127.0.0.1:8000"
    grpc_target: str = "127.0.0.1:50051"
    model: str | None = None  # None: the server's first model
    max_concurrency: int | None = None
    warmup: int = 0
    seed: int = 0
    burstiness: float = 1.0
    slo: SLO = field(default_factory=SLO)
    temperature: float = 0.0
    ignore_eos: bool = False
    api_key: str | None = None
    timeout_s: float = 600.0
    scrape_metrics: bool = True
    metrics_url: str | None = None
    show_progress: bool = True
    corpus: tuple[str, ...] | None = None
    tokenizer: TokenizerLike | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.request_rates or not all(r > 0 for r in self.request_rates):
            raise ValueError(f"--request-rate needs rates > 0, got {self.request_rates}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0 s, got {self.timeout_s}")

    @property
    def resolved_metrics_url(self) -> str:
        return self.metrics_url or f"{self.base_url.rstrip('/')}/metrics"


@dataclass(slots=True, frozen=True)
class RateResult:
    """One run at one request rate."""

    request_rate: float
    summary: Summary
    server: ServerFigures
    outputs: tuple[RequestOutput, ...]


@dataclass(slots=True, frozen=True)
class BenchResult:
    """A whole benchmark: one run per request rate, in the order given."""

    config: BenchConfig
    model: str
    runs: tuple[RateResult, ...]
    warmup_failed: int = 0
