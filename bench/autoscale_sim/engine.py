"""The discrete-event simulation: one trace through one cluster under one autoscaler.

The event loop merges the trace's arrivals with the event heap (request events: see
``flow``). Every ``interval_s`` the autoscaler decides; its actions start workers (ready
after their start-up time) or remove them: drained (no new requests; they stop once what
they hold is done) or killed (what they hold is lost, see ``flow``).
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.bench.autoscale_sim.flow import (
    ARRIVE,
    DFIN,
    DRAIN_LIMIT_S,
    KV,
    MIXED,
    READY,
    RETRY,
    SAMPLE,
    STOP,
    TICK,
    RequestFlow,
)
from pdserve.bench.autoscale_sim.metrics import RunResult, by_minute
from pdserve.bench.autoscale_sim.model import CostModel, Slo
from pdserve.bench.autoscale_sim.traces import Trace
from pdserve.bench.autoscale_sim.workers import (
    DRAINING,
    STARTING,
    DecodeWorker,
    PrefillWorker,
    Worker,
)

SAMPLE_S = 10.0


@dataclass(frozen=True, slots=True)
class Action:
    """Start ``start`` workers of ``role``; remove ``remove`` (drained, or killed)."""

    role: str
    start: int = 0
    remove: tuple[str, ...] = ()
    drain: bool = True


class Autoscaler(Protocol):
    """Decides every ``interval_s`` from what the simulation exposes (its workers, its
    recorder's windows), as a controller would from the cluster's metrics."""

    name: str
    interval_s: float

    def decide(self, now: float, sim: Simulation) -> list[Action]: ...


class Simulation(RequestFlow):
    """One trace through pools that start at ``pools`` (ready), under ``autoscaler``
    (None: fixed pools). ``run`` once."""

    def __init__(
        self,
        trace: Trace,
        cost: CostModel,
        slo: Slo,
        autoscaler: Autoscaler | None,
        pools: dict[str, int],
        seed: int = 0,
        policy: str = "joint_ttft",
    ) -> None:
        super().__init__(trace, cost, slo, seed, policy)
        self.autoscaler = autoscaler
        self.series: list[tuple[float, int, int, int, int]] = []
        self.decisions, self.decide_s, self.now = 0, 0.0, 0.0
        for role, count in pools.items():
            for _ in range(count):
                self.cluster.start(role, 0.0, ready=True)

    def run(self) -> RunResult:
        started = time.perf_counter()
        trace, events, end = self.trace, self.events, self.trace.end_s
        start = trace.warmup_s  # autoscalers decide and samples are taken from here on
        if self.autoscaler is not None:
            self.schedule(start + self.autoscaler.interval_s, TICK, None, 0)
        self.schedule(start, SAMPLE, None, 0)
        i, n = 0, len(trace)
        while True:
            arrival = trace.arrivals[i] if i < n else math.inf
            if events and events[0][0] < arrival:
                t, _, kind, a, b = heapq.heappop(events)
            elif i < n:
                t, kind, a, b = arrival, ARRIVE, i, 0
                i += 1
            else:
                break
            if t > end + DRAIN_LIMIT_S:
                break
            self.now = t
            self._dispatch(kind, a, b, t)
        return self._result(time.perf_counter() - started)

    def _dispatch(self, kind: int, a: Any, b: int, t: float) -> None:
        if kind == ARRIVE:
            self.recorder.arrival(t, self.trace.inputs[a])
            self._route(a, t)
        elif kind == RETRY:
            self._route(a, t)
        elif kind == KV:
            self._kv(a, b, t)
        elif kind == DFIN:
            self._dfin(a, b, t)
        elif kind == MIXED:
            self._mixed(a, t)
        elif kind == READY:
            self.cluster.make_ready(a, t)
        elif kind == STOP:
            if a.state == DRAINING:
                self.cluster.stop(a, t)
        elif kind == TICK:
            self._tick(t)
        elif kind == SAMPLE:
            self._sample(t)

    # workers and autoscaling ---------------------------------------------------------
    def _tick(self, now: float) -> None:
        assert self.autoscaler is not None
        t0 = time.perf_counter()
        actions = self.autoscaler.decide(now, self)
        self.decide_s += time.perf_counter() - t0
        self.decisions += 1
        for action in actions:
            self.apply(action, now)
        if now + self.autoscaler.interval_s <= self.trace.end_s:
            self.schedule(now + self.autoscaler.interval_s, TICK, None, 0)

    def apply(self, action: Action, now: float) -> None:
        for _ in range(action.start):
            self.cluster.start(action.role, now)
        chosen = set(action.remove)
        for w in [w for w in self.cluster.pools[action.role] if w.worker_id in chosen]:
            if not action.drain and w.state != STARTING:
                self._kill(w, now)
            elif self.cluster.drain(w, now):
                self.cluster.stop(w, now)
            elif isinstance(w, PrefillWorker):
                self.schedule(max(now, w.busy_until), STOP, w, 0)

    def _kill(self, w: Worker, now: float) -> None:
        """Removed without drain: whatever it holds is lost."""
        if isinstance(w, PrefillWorker):
            w.prune(now)
            for _, finish, r, _ in w.jobs:
                dw = self.where[r]
                current = self.prefill_of[r] is w and dw is not None and r in dw.pending_ids
                if finish > now and current and dw is not None:
                    dw.pending -= 1
                    dw.pending_ids.discard(r)
                    dw.reserved -= self.cost.blocks(self.trace.inputs[r] + self.trace.outputs[r])
                    self.cluster.touch(dw)
                    self._lose(r, now)
        elif isinstance(w, DecodeWorker):
            for r in [r for _, r in w.ends] + list(w.waiting) + list(w.pending_ids):
                self._lose(r, now)
        self.cluster.stop(w, now)

    def _sample(self, now: float) -> None:
        c = self.cluster
        self.series.append(
            (
                now - self.trace.warmup_s,
                len(c.pools["prefill"]),
                len(c.pools["decode"]),
                c.count("prefill", "ready"),
                c.count("decode", "ready"),
            )
        )
        if now + SAMPLE_S <= self.trace.end_s:
            self.schedule(now + SAMPLE_S, SAMPLE, None, 0)

    def _result(self, wall_s: float) -> RunResult:
        """Counts the requests that arrived after the warm-up."""
        rec, trace = self.recorder, self.trace
        for r in range(len(trace)):
            if not rec.finished[r]:
                rec.give_up(r)  # still unserved when the simulation stopped
        self.cluster.close()
        first = bisect.bisect_left(trace.arrivals, trace.warmup_s)
        counted = slice(first, len(trace))
        arrivals = [t - trace.warmup_s for t in trace.arrivals[counted]]
        c = self.cluster
        minutes = max(1, math.ceil(trace.duration_s / 60))
        shares, missed = by_minute(arrivals, rec.good[counted], minutes)
        return RunResult(
            trace.name,
            self.autoscaler.name if self.autoscaler else "fixed",
            len(arrivals),
            sum(rec.good[counted]),
            sum(rec.ttft_ok[counted]),
            sum(rec.tpot_ok[counted]),
            sum(rec.gave_up[counted]),
            sum(self.retried[counted]),
            sum(self.lost[counted]),
            c.worker_seconds / 3600.0,
            c.peak,
            c.peak_by_role["prefill"],
            c.peak_by_role["decode"],
            self.series,
            shares,
            missed,
            self.decisions,
            1000.0 * self.decide_s / max(1, self.decisions),
            wall_s,
        )
