"""One router's metrics, goodput, recent latencies and worker stats, in one place.

``start_router`` builds a ``RouterObservability``: the request lifecycle reports finished
requests to it (``record_ok`` / ``record_failure``), /metrics and /dashboard read it, and,
when ``SloConfig.redis_url`` is set, a task publishes the goodput figures to Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from pdserve.router.config import RouterConfig
from pdserve.router.observe.goodput import (
    GoodputFigures,
    RequestSample,
    SlidingGoodput,
    SloConfig,
    tpot_s,
)
from pdserve.router.observe.goodput_store import GoodputStore
from pdserve.router.observe.latency_window import LatencyWindow
from pdserve.router.observe.metrics import RouterMetrics
from pdserve.router.observe.worker_stats import WorkerSnapshot, WorkerStatsPoller, WorkerTotals
from pdserve.router.request.types import Summary
from pdserve.router.state.directory import ChannelPool, WorkerDirectory
from pdserve.router.state.link_rates import LinkRates, WorkerPair

log = logging.getLogger(__name__)

LATENCY_WINDOW_S = 10.0  # the dashboard's p50/p90/p99 cover this many recent seconds


class RouterObservability:
    """Implements ``pdserve.router.observe.metrics.LiveSource``; owns the goodput publisher task."""

    def __init__(
        self,
        config: RouterConfig,
        directory: WorkerDirectory,
        channels: ChannelPool,
        clock: Callable[[], float] = time.monotonic,
        link_rates: LinkRates | None = None,
    ) -> None:
        self.slo: SloConfig = config.slo
        self._link_rates = link_rates or LinkRates()
        self.directory = directory
        self.clock = clock
        self.started_s = clock()
        self.goodput_window = SlidingGoodput(self.slo, since_s=self.started_s)
        self.ttft_window = LatencyWindow(LATENCY_WINDOW_S)
        self.itl_window = LatencyWindow(LATENCY_WINDOW_S)
        self.poller = WorkerStatsPoller(
            directory, channels, timeout_s=min(1.0, config.worker_rpc_timeout_s)
        )
        self.metrics = RouterMetrics(live=self)
        self.store: GoodputStore | None = None
        self._task: asyncio.Task[None] | None = None

    # -- recording -------------------------------------------------------------------------

    def record_tokens(self, prompt_tokens: int, generated_tokens: int) -> None:
        """Tokens as they stream: the prompt once, at the request's first chunk."""
        if prompt_tokens:
            self.metrics.prompt_tokens.inc(prompt_tokens)
        if generated_tokens:
            self.metrics.generation_tokens.inc(generated_tokens)

    def record_ok(self, summary: Summary, n: int) -> None:
        """A request that completed; ``n`` sequences shared its completion tokens."""
        timing = summary.timing
        tokens_per_sequence = summary.usage.completion_tokens / max(1, n)
        tpot = tpot_s(timing.e2e_s, timing.ttft_s, tokens_per_sequence)
        now_s = self.clock()
        self.metrics.observe_outcome("ok")
        self.metrics.observe_timing(timing, tpot)
        usage = summary.usage
        self.goodput_window.record(
            RequestSample(
                now_s, timing.ttft_s, tpot, False, usage.prompt_tokens, usage.completion_tokens
            )
        )
        self.ttft_window.add(now_s, timing.ttft_s)
        self.itl_window.add_many(now_s, timing.itl_s)

    def record_failure(
        self, outcome: str, misses_slo: bool, demand: tuple[int, int] = (0, 0)
    ) -> None:
        """A request that did not complete. ``misses_slo``: counts against SLO attainment
        (errors and overload refusals do; client cancellations and bad input do not).
        ``demand``: the prompt and output tokens it asked for, counted in the token rates so
        that load turned away still shows."""
        self.metrics.observe_outcome(outcome)
        if misses_slo:
            prompt_tokens, output_tokens = demand
            sample = RequestSample(self.clock(), math.inf, None, True, prompt_tokens, output_tokens)
            self.goodput_window.record(sample)

    # -- LiveSource ------------------------------------------------------------------------

    def pool_sizes(self) -> dict[str, int]:
        return dict(Counter(w.role.value for w in self.directory.live_workers()))

    def worker_snapshots(self) -> Sequence[WorkerSnapshot]:
        return self.poller.live()

    def worker_up(self) -> dict[str, bool]:
        return self.poller.up()

    def worker_totals(self) -> Sequence[WorkerTotals]:
        return self.poller.totals()

    def goodput(self) -> Sequence[GoodputFigures]:
        return self.goodput_window.figures(self.clock())

    def link_rates(self) -> Mapping[WorkerPair, float]:
        return self._link_rates.rates(time.monotonic())  # the table's clock, not self.clock

    # -- serving ---------------------------------------------------------------------------

    async def exposition(self) -> bytes:
        """Fresh worker stats, then the text exposition of every metric."""
        await self.poller.refresh()
        return self.metrics.exposition()

    def start(self) -> None:
        """Start publishing goodput to Redis when a URL is configured."""
        if self.slo.redis_url and self._task is None:
            self.store = GoodputStore.from_url(self.slo)
            self._task = asyncio.create_task(self.store.run(self.goodput))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.store is not None:
            self.store.close()
            self.store = None
