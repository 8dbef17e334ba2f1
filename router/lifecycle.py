"""Per-request orchestration: admit, route, call workers, stream chunks, record timing.

``RequestLifecycle.generate`` is an async generator of ``ChunkEvent`` followed by one
``Summary``. Closing it early (client disconnect, cancellation) cancels the worker streams
and sends Cancel to every worker involved, so their KV is freed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace

from router.admission import ConcurrencyLimiter, LocalLoadTracker
from router.config import RouterConfig
from router.directory import ChannelPool, WorkerDirectory, WorkerInfo
from router.dispatch import Attempt, RetryableWorkerError
from router.errors import NoWorkersError, OverloadedError, WorkerFailedError
from router.fanout import fan_out_inputs, merge_streams
from router.locality import LocalityIndex, PromptBlockHasher
from router.policies import (
    POLICY_NAMES,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    WorkerCandidate,
    make_policy,
    normalize_policy_name,
)
from router.prefix_lookup import cached_blocks
from router.request import (
    ChunkEvent,
    GenerateInput,
    InMemoryTimingSink,
    RequestTiming,
    Summary,
    TimingSink,
    Usage,
)
from router.worker_calls import WorkerCalls


@dataclass(slots=True)
class _Route:
    """One request's routing snapshot and, once served, the attempt that served it."""

    inp: GenerateInput
    request: RouteRequest
    ranked: list[RouteDecision]
    calls: WorkerCalls
    deadline_at: float | None
    served_by: Attempt | None = None
    dispatched_s: float | None = None


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
    ) -> None:
        self.config = config
        self.directory = directory
        self.channels = channels
        self.locality = locality
        self.hasher = hasher
        self.timing_sink: TimingSink = timing_sink or InMemoryTimingSink()
        self.limiter = ConcurrencyLimiter(config.max_concurrent_requests, config.retry_after_s)
        self.tracker = LocalLoadTracker()
        self._policies: dict[str, RoutingPolicy] = {
            name: make_policy(name, config.cost, config.hot_spot_margin_requests)
            for name in POLICY_NAMES
        }
        self._background: set[asyncio.Task[None]] = set()

    async def generate(self, inp: GenerateInput) -> AsyncGenerator[ChunkEvent | Summary, None]:
        """Chunks as the workers produce them, then a ``Summary``; raises router errors."""
        self.limiter.acquire()
        try:
            route = await self._route(inp)
            async with aclosing(self._chunks(route)) as chunks:
                async for event in self._timed(route, chunks):
                    yield event
        finally:
            self.limiter.release()

    async def _route(self, inp: GenerateInput) -> _Route:
        policy_name = inp.routing_policy or self.config.default_policy
        policy = self._policies[normalize_policy_name(policy_name)]
        workers = [w for w in self.directory.live_workers() if not w.model or w.model == inp.model]
        if not workers:
            raise NoWorkersError(f"no live worker serves model {inp.model!r}")
        ids = [w.worker_id for w in workers]
        cached = await cached_blocks(self.locality, self.hasher, inp.prompt_token_ids, ids)
        request = RouteRequest(len(inp.prompt_token_ids), self.config.block_size, cached)
        ranked = policy.rank(request, [self._candidate(w) for w in workers])
        calls = WorkerCalls(
            self.config,
            self.channels,
            self.tracker,
            {w.worker_id: w for w in workers},
            self._background,
        )
        return _Route(inp, request, ranked, calls, self._deadline_at(inp))

    def _candidate(self, worker: WorkerInfo) -> WorkerCandidate:
        load = self.tracker.effective_load(worker.worker_id, worker.load)
        return WorkerCandidate(worker.worker_id, worker.role, load)

    def _deadline_at(self, inp: GenerateInput) -> float | None:
        deadline_s = inp.deadline_s or self.config.request_timeout_s
        return inp.arrival_s + deadline_s if deadline_s > 0 else None

    def _chunks(self, route: _Route) -> AsyncGenerator[ChunkEvent, None]:
        if route.inp.params.n > 1 and route.ranked and not route.ranked[0].colocated:
            return self._fan_out(route)
        return self._serve(route)

    async def _fan_out(self, route: _Route) -> AsyncGenerator[ChunkEvent, None]:
        """n sequences as n one-sequence requests: a DecodeRequest carries one first token."""
        subs = [replace(route, inp=sub) for sub in fan_out_inputs(route.inp)]
        async with aclosing(merge_streams([self._serve(sub) for sub in subs])) as merged:
            async for index, chunk in merged:
                yield replace(chunk, index=index)
        route.served_by = subs[0].served_by
        starts = [sub.dispatched_s for sub in subs if sub.dispatched_s is not None]
        route.dispatched_s = min(starts, default=None)

    async def _serve(self, route: _Route) -> AsyncGenerator[ChunkEvent, None]:
        """Walk the ranking until one attempt completes (see module docstring of dispatch)."""
        failed: set[str] = set()
        refused: set[str] = set()
        failures: list[str] = []
        for decision in route.ranked:
            if len(failures) >= self.config.max_attempts:
                break
            if _skip(decision, failed, refused):
                continue
            attempt = Attempt(
                route.calls,
                route.inp,
                decision,
                _attempt_id(route.inp, failures, refused),
                route.deadline_at,
            )
            try:
                async with aclosing(attempt.run()) as chunks:
                    async for chunk in chunks:
                        yield chunk
            except RetryableWorkerError as err:
                attempt.abort()
                failures.append(str(err))
                failed.add(err.worker_id)
                continue
            except BaseException:
                attempt.abort()
                raise
            finally:
                if route.dispatched_s is None:
                    route.dispatched_s = attempt.dispatched_s
            if attempt.refused:
                refused.add(decision.decode_worker_id or "")
                continue
            route.served_by = attempt
            return
        raise _exhausted(route, failures, refused)

    async def _timed(
        self, route: _Route, chunks: AsyncGenerator[ChunkEvent, None]
    ) -> AsyncGenerator[ChunkEvent | Summary, None]:
        inp = route.inp
        clock = _Clock(inp.arrival_s)
        unfinished = set(range(inp.params.n))
        completion_tokens = 0
        async for chunk in chunks:
            clock.tick()
            completion_tokens += len(chunk.token_ids)
            if chunk.finish_reason is not None:
                unfinished.discard(chunk.index)
                if not unfinished:
                    chunk = replace(chunk, is_last=True)
            yield chunk
        if unfinished:
            raise WorkerFailedError(
                f"request {inp.request_id}: the worker stream ended before sequences "
                f"{sorted(unfinished)} finished"
            )
        yield self._summary(route, clock, completion_tokens)

    def _summary(self, route: _Route, clock: _Clock, completion_tokens: int) -> Summary:
        inp, attempt = route.inp, route.served_by
        assert attempt is not None, f"request {inp.request_id} finished without an attempt"
        dispatched_s = route.dispatched_s or inp.arrival_s
        timing = clock.timing(queue_s=dispatched_s - inp.arrival_s, transfer_s=attempt.transfer_s)
        self.timing_sink.record(inp.request_id, timing)
        prefill_id = attempt.decision.prefill_worker_id
        usage = Usage(
            prompt_tokens=len(inp.prompt_token_ids),
            completion_tokens=completion_tokens,
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


class _Clock:
    """TTFT, inter-chunk gaps and end-to-end time, from the request's arrival."""

    __slots__ = ("arrival_s", "first_s", "gaps_s", "last_s")

    def __init__(self, arrival_s: float) -> None:
        self.arrival_s = arrival_s
        self.first_s: float | None = None
        self.last_s = arrival_s
        self.gaps_s: list[float] = []

    def tick(self) -> None:
        now = time.monotonic()
        if self.first_s is None:
            self.first_s = now
        else:
            self.gaps_s.append(now - self.last_s)
        self.last_s = now

    def timing(self, queue_s: float, transfer_s: float) -> RequestTiming:
        now = time.monotonic()
        first_s = self.first_s if self.first_s is not None else now
        return RequestTiming(
            ttft_s=first_s - self.arrival_s,
            e2e_s=now - self.arrival_s,
            queue_s=max(0.0, queue_s),
            transfer_s=transfer_s,
            itl_s=tuple(self.gaps_s),
        )


def _skip(decision: RouteDecision, failed: set[str], refused: set[str]) -> bool:
    if decision.prefill_worker_id in failed or decision.decode_worker_id in failed:
        return True
    return decision.decode_worker_id is not None and decision.decode_worker_id in refused


def _attempt_id(inp: GenerateInput, failures: Sequence[str], refused: set[str]) -> str:
    # A retry uses a fresh id: a late Cancel for the failed attempt must not hit this one.
    tries = len(failures) + len(refused)
    return inp.request_id if tries == 0 else f"{inp.request_id}#{tries}"


def _exhausted(route: _Route, failures: list[str], refused: set[str]) -> Exception:
    rid = route.inp.request_id
    if failures:
        return WorkerFailedError(
            f"request {rid} failed on {len(failures)} worker(s): {'; '.join(failures)}"
        )
    if refused:
        return OverloadedError(
            f"request {rid}: no decode worker has room for {route.request.blocks_needed} KV "
            f"blocks (refused by {sorted(refused)})",
            route.calls.config.retry_after_s,
        )
    return NoWorkersError(f"request {rid}: no worker available to route to")
