"""``RequestLifecycle`` that reports every request's tokens, latencies and outcome.

Both edges (gRPC and HTTP) go through ``RequestLifecycle.generate``, which shows each
request's watch (``_watch``) every event and how the request ended, however it ends:

| how it ends | outcome | SLO attainment |
|---|---|---|
| a ``Summary`` (the last event) | ok | measured against the targets |
| ``OverloadedError`` (429 / RESOURCE_EXHAUSTED) | rejected | missed |
| ``InvalidRequestError`` (a worker refused the input) | rejected | not counted |
| closed early (client gone, cancelled) | cancelled | not counted |
| any other error | error | missed |
"""

from __future__ import annotations

import asyncio

from pdserve.router.config import RouterConfig
from pdserve.router.edge.errors import InvalidRequestError, OverloadedError
from pdserve.router.observe.observability import RouterObservability
from pdserve.router.request.failover_text import TextDecoder
from pdserve.router.request.lifecycle import RequestLifecycle
from pdserve.router.request.types import ChunkEvent, GenerateInput, Summary, TimingSink
from pdserve.router.state.directory import ChannelPool, WorkerDirectory
from pdserve.router.state.link_rates import LinkRates
from pdserve.router.state.locality import LocalityIndex, PromptBlockHasher


class MeteredLifecycle(RequestLifecycle):
    """The router's lifecycle with ``observability`` told about each request."""

    def __init__(
        self,
        config: RouterConfig,
        directory: WorkerDirectory,
        channels: ChannelPool,
        observability: RouterObservability,
        locality: LocalityIndex | None = None,
        hasher: PromptBlockHasher | None = None,
        timing_sink: TimingSink | None = None,
        text_decoder: TextDecoder | None = None,
        link_rates: LinkRates | None = None,
    ) -> None:
        super().__init__(
            config, directory, channels, locality, hasher, timing_sink,
            text_decoder=text_decoder, link_rates=link_rates,
        )  # fmt: skip
        self.observability = observability

    def _watch(self, inp: GenerateInput) -> _RequestWatch:
        return _RequestWatch(self.observability, inp)


class _RequestWatch:
    """Follows one request's events to its outcome; reports each figure exactly once."""

    __slots__ = ("done", "inp", "obs", "started")

    def __init__(self, obs: RouterObservability, inp: GenerateInput) -> None:
        self.obs = obs
        self.inp = inp
        self.started = False
        self.done = False

    def saw(self, event: ChunkEvent | Summary) -> None:
        if isinstance(event, Summary):
            self.done = True
            self.obs.record_ok(event, self.inp.params.n)
            return
        prompt_tokens = 0 if self.started else len(self.inp.prompt_token_ids)
        self.started = True
        self.obs.record_tokens(prompt_tokens, len(event.token_ids))

    def ended_by(self, err: BaseException) -> None:
        if self.done:
            return
        self.done = True
        if isinstance(err, GeneratorExit | asyncio.CancelledError):
            self.obs.record_failure("cancelled", misses_slo=False)
        elif isinstance(err, OverloadedError):
            self.obs.record_failure("rejected", misses_slo=True, demand=self._demand())
        elif isinstance(err, InvalidRequestError):
            self.obs.record_failure("rejected", misses_slo=False)
        else:
            self.obs.record_failure("error", misses_slo=True, demand=self._demand())

    def _demand(self) -> tuple[int, int]:
        """What a request that was not served asked for: its prompt and, at most, its
        output tokens (the autoscaler must see load it turned away)."""
        params = self.inp.params
        return len(self.inp.prompt_token_ids), params.max_tokens * params.n

    def closed(self) -> None:
        if not self.done:  # closed between events without an exception reaching us
            self.done = True
            self.obs.record_failure("cancelled", misses_slo=False)
