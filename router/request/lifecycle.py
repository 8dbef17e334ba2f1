"""Per-request orchestration: admit, route, call workers, stream chunks, record timing.

``RequestLifecycle.generate`` is an async generator of ``ChunkEvent`` followed by one
``Summary``. Closing it early (client disconnect, cancellation) cancels the worker streams
and sends Cancel to every worker involved, so their KV is freed. A worker failing before the
first token is retried on the next routing decision (router/request/dispatch.py); a stream breaking
after it is continued on other workers by replaying prompt + sent tokens
(router/request/failover.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import replace

from pdserve.proto.workers import WorkerInfo
from pdserve.router.config import RouterConfig
from pdserve.router.edge.errors import NoWorkersError, OverloadedError, WorkerFailedError
from pdserve.router.observe.goodput import tpot_s
from pdserve.router.policies import (
    POLICY_NAMES,
    PrefixHit,
    RouteRequest,
    RoutingPolicy,
    WorkerCandidate,
    make_policy,
    normalize_policy_name,
)
from pdserve.router.request.dispatch import StreamBrokenError
from pdserve.router.request.failover import FailoverConfig, Refusal, ReplayPlan, SequenceStream
from pdserve.router.request.failover_text import TextDecoder
from pdserve.router.request.fanout import fan_out_inputs, merge_streams
from pdserve.router.request.progress import Progress, RequestWatch
from pdserve.router.request.route_walk import Route, walk
from pdserve.router.request.types import (
    ChunkEvent,
    GenerateInput,
    InMemoryTimingSink,
    Summary,
    TimingSink,
    Usage,
)
from pdserve.router.request.worker_calls import WorkerCalls
from pdserve.router.state.admission import ConcurrencyLimiter, LocalLoadTracker, SloShedding
from pdserve.router.state.directory import ChannelPool, WorkerDirectory
from pdserve.router.state.link_rates import LinkRates
from pdserve.router.state.locality import BlockHash, LocalityIndex, PromptBlockHasher
from pdserve.router.state.placements import RecentPlacements
from pdserve.router.state.prefix_lookup import prefix_hits

log = logging.getLogger(__name__)


class RequestLifecycle:
    """Serves requests against the workers of ``directory``."""

    def __init__(
        self,
        config: RouterConfig,
        directory: WorkerDirectory,
        channels: ChannelPool,
        locality: LocalityIndex | None = None,
        hasher: PromptBlockHasher | None = None,
        timing_sink: TimingSink | None = None,
        failover: FailoverConfig | None = None,
        text_decoder: TextDecoder | None = None,
        link_rates: LinkRates | None = None,
    ) -> None:
        self.config = config
        self.failover = failover or FailoverConfig()
        # The router's tokenizer: after a failover the router makes the text itself
        # (router/request/failover_text.py). Without it only breaks where the worker held no
        # text back can fail over.
        self.text_decoder = text_decoder
        self.directory = directory
        self.channels = channels
        self.locality = locality
        self.hasher = hasher
        self.timing_sink: TimingSink = timing_sink or InMemoryTimingSink()
        self.limiter = ConcurrencyLimiter(
            config.max_concurrent_requests,
            config.retry_after_s,
            floor=min(config.min_concurrent_requests, config.max_concurrent_requests),
            cooldown_s=config.slo.ttft_s,
            adaptive=config.adaptive_concurrency,
        )
        self.shedding = SloShedding(config.shed_ttft_factor * config.slo.ttft_s)
        self.tracker = LocalLoadTracker()
        self.placements = RecentPlacements()
        # Fed by the prefill workers' transfer reports (dispatch.py), read by routing.
        self.link_rates = link_rates or LinkRates()
        self._policies: dict[str, RoutingPolicy] = {
            name: make_policy(name, config.cost, config.hot_spot_margin_requests, config.peer_fetch)
            for name in POLICY_NAMES
        }
        self._background: set[asyncio.Task[None]] = set()

    async def generate(self, inp: GenerateInput) -> AsyncGenerator[ChunkEvent | Summary, None]:
        """Chunks as the workers produce them, then a ``Summary``; raises router errors.

        The request's watch (``_watch``) sees every event and how the request ended. Timing
        and the watch live in this one generator: each layer of async generator costs every
        chunk a resume.
        """
        watch = self._watch(inp)
        try:
            self.limiter.acquire()
            try:
                route = await self._route(inp)
                progress = Progress(inp.arrival_s, inp.params.n)
                async with aclosing(self._chunks(route)) as chunks:
                    async for chunk in chunks:
                        first = progress.first_s is None
                        chunk = progress.saw(chunk)
                        if watch is not None:
                            watch.saw(chunk)
                        yield chunk
                        if first:
                            self._judge_first_token(progress)
                summary = self._summary(route, progress)
                self._judge_end(summary, inp.params.n)
                if watch is not None:
                    watch.saw(summary)
                yield summary
            finally:
                self.limiter.release()
        except BaseException as err:
            if watch is not None:
                watch.ended_by(err)
            raise
        finally:
            if watch is not None:
                watch.closed()

    def _judge_first_token(self, progress: Progress) -> None:
        """A late first token tells the limiter at once (the sooner it cuts, the fewer wait)."""
        assert progress.first_s is not None
        if progress.first_s - progress.arrival_s > self.config.slo.ttft_s:
            self.limiter.missed(progress.first_s)

    def _judge_end(self, summary: Summary, n: int) -> None:
        timing, slo = summary.timing, self.config.slo
        if timing.ttft_s > slo.ttft_s:
            return  # told at the first token
        tpot = tpot_s(timing.e2e_s, timing.ttft_s, summary.usage.completion_tokens / n)
        if tpot is not None and tpot > slo.tpot_s:
            self.limiter.missed(time.monotonic())
        else:
            self.limiter.met()

    def _watch(self, inp: GenerateInput) -> RequestWatch | None:
        """What follows ``inp`` to its end (router/request/metered_lifecycle.py); None: nothing."""
        return None

    async def _route(self, inp: GenerateInput) -> Route:
        policy_name = inp.routing_policy or self.config.default_policy
        policy = self._policies.get(policy_name)
        if policy is None:
            policy = self._policies[normalize_policy_name(policy_name)]
        workers = [w for w in self.directory.live_workers() if not w.model or w.model == inp.model]
        if not workers:
            raise NoWorkersError(f"no live worker serves model {inp.model!r}")
        request, hashes = await self._route_request(inp, [w.worker_id for w in workers])
        ranked = policy.rank(request, [self._candidate(w) for w in workers])
        self.shedding.check(ranked)
        if ranked and hashes:
            chosen = ranked[0].prefill_worker_id
            fetch = ranked[0].fetch
            held = fetch.num_blocks if fetch is not None else request.hit(chosen).blocks
            self.placements.record(chosen, hashes, held, time.monotonic())
        calls = WorkerCalls(
            self.config,
            self.channels,
            self.tracker,
            {w.worker_id: w for w in workers},
            self._background,
            self.link_rates,
        )
        return Route(inp, request, ranked, calls, self._deadline_at(inp))

    async def _route_request(
        self, inp: GenerateInput, worker_ids: list[str]
    ) -> tuple[RouteRequest, Sequence[BlockHash]]:
        """What routing knows of ``inp``: per worker, the prompt blocks it holds (locality
        index, or just sent there) and the new prefix it was given lately; and the
        prompt's block hashes (empty without a hasher); and the links' measured rates (none
        when the router is blind to links: ``RouterConfig.link_aware``)."""
        size = self.config.block_size
        links = self.link_rates.rates(time.monotonic()) if self.config.link_aware else {}
        if self.hasher is None:
            return RouteRequest(len(inp.prompt_token_ids), size, link_rates=links), ()
        hashes = self.hasher(inp.prompt_token_ids)
        hits = await prefix_hits(self.locality, hashes, worker_ids)
        now_s = time.monotonic()
        pending = {}
        for worker_id, sent in self.placements.longest_prefix(hashes, worker_ids, now_s).items():
            indexed = hits.get(worker_id, PrefixHit()).blocks
            if sent > indexed:  # sent there just now: in its pool once computed
                hits[worker_id] = PrefixHit(sent)
                pending[worker_id] = sent - indexed
        new = self.placements.new_blocks(worker_ids, now_s)
        request = RouteRequest(len(inp.prompt_token_ids), size, hits, new, pending, links)
        return request, hashes

    def _candidate(self, worker: WorkerInfo) -> WorkerCandidate:
        load = self.tracker.effective_load(worker.worker_id, worker.load)
        return WorkerCandidate(worker.worker_id, worker.role, load)

    def _deadline_at(self, inp: GenerateInput) -> float | None:
        deadline_s = inp.deadline_s or self.config.request_timeout_s
        return inp.arrival_s + deadline_s if deadline_s > 0 else None

    def _chunks(self, route: Route) -> AsyncGenerator[ChunkEvent, None]:
        if route.inp.params.n > 1 and route.ranked and not route.ranked[0].colocated:
            return self._fan_out(route)
        return self._serve(route)

    async def _fan_out(self, route: Route) -> AsyncGenerator[ChunkEvent, None]:
        """n sequences as n one-sequence requests: a DecodeRequest carries one first token."""
        subs = [replace(route, inp=sub) for sub in fan_out_inputs(route.inp)]
        async with aclosing(merge_streams([self._serve(sub) for sub in subs])) as merged:
            async for index, chunk in merged:
                yield replace(chunk, index=index)
        route.served_by = subs[0].served_by
        starts = [sub.dispatched_s for sub in subs if sub.dispatched_s is not None]
        route.dispatched_s = min(starts, default=None)

    async def _serve(self, route: Route) -> AsyncGenerator[ChunkEvent, None]:
        """Serve ``route``; a stream that breaks after tokens went out goes on elsewhere."""
        stream = SequenceStream(route.inp.prompt_token_ids, route.inp.params)
        failed: set[str] = set()  # workers that failed this request: not tried again
        current, plan = route, None
        while True:
            try:
                if plan is not None:
                    current = await self._replay_route(route, plan)
                async with aclosing(walk(current, failed, self.config.max_attempts)) as chunks:
                    async for chunk in chunks:
                        yield stream.deliver(chunk)
                        if stream.finished_by_router:
                            break  # closing the walk cancels the worker's stream
                route.served_by = current.served_by
                return
            except StreamBrokenError as err:
                if stream.finished:  # the break came after the last token: nothing is lost
                    route.served_by = current.served_by
                    return
                plan = self._plan_failover(route, stream, err, failed)
            except (NoWorkersError, OverloadedError, WorkerFailedError) as err:
                if plan is None:
                    raise
                message = stream.failed_after_failover(err)
                raise WorkerFailedError(f"request {route.inp.request_id}: {message}") from err

    def _plan_failover(
        self, route: Route, stream: SequenceStream, err: StreamBrokenError, failed: set[str]
    ) -> ReplayPlan:
        rid = route.inp.request_id
        plan = stream.fail_over(err.brk, self.failover, self.text_decoder)
        if isinstance(plan, Refusal):
            raise WorkerFailedError(f"request {rid}: {plan.message}") from err
        failed.add(plan.exclude)
        log.warning(
            "request %s: %s broke the stream after %d tokens; failover %d of %d replays "
            "prompt + sent tokens (%d) elsewhere",
            rid,
            err.brk.describe(),
            plan.delivered_tokens,
            plan.failover,
            self.failover.max_failovers,
            len(plan.prompt_token_ids),
        )
        return plan

    async def _replay_route(self, route: Route, plan: ReplayPlan) -> Route:
        """A fresh routing of the replay (a new id: late Cancels of the old one miss it)."""
        inp = replace(
            route.inp,
            request_id=f"{route.inp.request_id}+f{plan.failover}",
            prompt_token_ids=plan.prompt_token_ids,
            params=plan.params,
        )
        return await self._route(inp)

    def _summary(self, route: Route, progress: Progress) -> Summary:
        inp, attempt = route.inp, route.served_by
        if progress.unfinished:
            raise WorkerFailedError(
                f"request {inp.request_id}: the worker stream ended before sequences "
                f"{sorted(progress.unfinished)} finished"
            )
        assert attempt is not None, f"request {inp.request_id} finished without an attempt"
        dispatched_s = route.dispatched_s or inp.arrival_s
        timing = progress.timing(
            queue_s=dispatched_s - inp.arrival_s, transfer_s=attempt.transfer_s
        )
        self.timing_sink.record(inp.request_id, timing)
        prefill_id = attempt.decision.prefill_worker_id
        usage = Usage(
            prompt_tokens=len(inp.prompt_token_ids),
            completion_tokens=progress.completion_tokens,
            cached_prompt_tokens=route.request.cached_tokens(prefill_id),
        )
        return Summary(
            inp.request_id,
            usage,
            timing,
            prefill_id,
            attempt.decision.decode_worker_id or "",
            attempt.decision.policy,
        )

    async def close(self) -> None:
        """Let background Cancel calls finish, then close the worker channels."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.channels.close()
