"""What happens to a request: routing, prefill, KV transfer, decode, refusals and retries.

A request is routed on arrival (the router's policy; the decode worker reserves the prompt
and output blocks, as ReserveKV does before Prefill), prefilled FCFS, its KV moved, then
decoded in a continuous batch. No decode worker with room: 429, and the client retries
after 0.5, 1, 2, ... s (6 times, then it has failed). A request whose worker is removed
without drain is lost and starts again from scratch. Latencies count from its first arrival.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from pdserve.bench.autoscale_sim.cluster import Cluster
from pdserve.bench.autoscale_sim.metrics import Recorder
from pdserve.bench.autoscale_sim.model import CostModel, Slo
from pdserve.bench.autoscale_sim.router import Router
from pdserve.bench.autoscale_sim.traces import Trace
from pdserve.bench.autoscale_sim.workers import (
    DRAINING,
    STOPPED,
    ColocatedWorker,
    DecodeWorker,
    PrefillWorker,
)

ARRIVE, RETRY, KV, DFIN, READY, STOP, TICK, SAMPLE, MIXED = range(9)
MAX_REFUSALS = 6
BACKOFF_S = 0.5
DRAIN_LIMIT_S = 3600.0


class RequestFlow:
    """The requests' state (one slot each) and the event handlers that move them."""

    def __init__(self, trace: Trace, cost: CostModel, slo: Slo, seed: int, policy: str) -> None:
        self.trace, self.cost, self.slo = trace, cost, slo
        n = len(trace)
        self.attempt = [0] * n
        self.refusals = [0] * n
        self.retried = bytearray(n)
        self.lost = bytearray(n)
        self.first_s = [0.0] * n
        self.where: list[DecodeWorker | None] = [None] * n
        self.prefill_of: list[PrefillWorker | None] = [None] * n
        self.events: list[tuple[float, int, int, Any, int]] = []
        self._seq = itertools.count()
        horizon = (trace.warmup_s, trace.end_s)
        self.cluster = Cluster(cost, horizon, seed, self.schedule, READY)
        self.recorder = Recorder(slo, n, trace.end_s + DRAIN_LIMIT_S)
        self.router = Router(cost, policy)

    def schedule(self, t: float, kind: int, a: Any, b: int) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, a, b))

    def _route(self, r: int, now: float) -> None:
        cost, inp, out = self.cost, self.trace.inputs[r], self.trace.outputs[r]
        need = cost.blocks(inp + out)
        decisions, by_id = self.router.rank(self.cluster, inp, need, now)
        if not decisions:
            return self._refuse(r, now)
        if decisions[0].decode_worker_id is None:
            worker = by_id[decisions[0].prefill_worker_id]
            assert isinstance(worker, ColocatedWorker)
            return self._colocate(worker, r, need, now)
        for d in decisions:
            dw = by_id[d.decode_worker_id or ""]
            assert isinstance(dw, DecodeWorker)
            if dw.reserve(need, cost):
                break
        else:
            return self._refuse(r, now)
        pw = by_id[d.prefill_worker_id]
        assert isinstance(pw, PrefillWorker)
        finish = pw.enqueue(now, r, inp, cost.prefill_s(inp))
        self.cluster.touch(pw)
        self.cluster.touch(dw)
        dw.pending += 1
        dw.pending_ids.add(r)
        self.first_s[r], self.where[r], self.prefill_of[r] = finish, dw, pw
        self.schedule(finish + cost.transfer_s(inp), KV, r, self.attempt[r])

    def _refuse(self, r: int, now: float) -> None:
        self.refusals[r] += 1
        self.retried[r] = 1
        self.recorder.refused(now, self.trace.inputs[r], self.trace.outputs[r])
        if self.refusals[r] > MAX_REFUSALS:
            self.recorder.give_up(r)
        else:
            self.schedule(now + BACKOFF_S * 2 ** (self.refusals[r] - 1), RETRY, r, 0)

    def _lose(self, r: int, now: float) -> None:
        """Its worker went away without drain: the client starts it again."""
        self.attempt[r] += 1
        self.lost[r] = self.retried[r] = 1
        self.recorder.refused(now, self.trace.inputs[r], self.trace.outputs[r])
        self.schedule(now, RETRY, r, 0)

    def _kv(self, r: int, attempt: int, now: float) -> None:
        if attempt != self.attempt[r]:
            return  # lost meanwhile
        dw = self.where[r]
        assert dw is not None
        dw.pending -= 1
        dw.pending_ids.discard(r)
        dw.advance(now)
        if dw.running < self.cost.max_num_seqs:
            self._admit(dw, r, now)
        else:
            dw.waiting.append(r)
            dw.queue_peak = max(dw.queue_peak, len(dw.waiting))
        self._retime(dw)

    def _admit(self, w: DecodeWorker, r: int, now: float) -> None:
        inp, out = self.trace.inputs[r], self.trace.outputs[r]
        w.admit(now, r, out - 1, inp + out / 2)

    def _dfin(self, w: DecodeWorker, version: int, now: float) -> None:
        if version != w.version or w.state == STOPPED:
            return
        w.advance(now)
        for r in w.pop_finished():
            self._finish(w, r, now)
        while w.waiting and w.running < self.cost.max_num_seqs:
            self._admit(w, w.waiting.popleft(), now)
        if isinstance(w, ColocatedWorker):
            self._fill_prompts(w, now)
        self._retime(w)
        if w.state == DRAINING and w.idle:
            self.cluster.stop(w, now)

    def _finish(self, w: DecodeWorker, r: int, now: float) -> None:
        inp, out = self.trace.inputs[r], self.trace.outputs[r]
        w.running -= 1
        w.context_sum = w.context_sum - (inp + out / 2) if w.running else 0.0
        w.reserved -= self.cost.blocks(inp + out)
        self.cluster.touch(w)
        arrival = self.trace.arrivals[r]
        ttft = self.first_s[r] + self.cost.rpc_s - arrival
        tpot = (now - self.first_s[r]) / (out - 1) if out > 1 else None
        self.recorder.finish(r, now, ttft, tpot, arrival, inp, out)

    def _retime(self, w: DecodeWorker) -> None:
        t = w.retime(self.cost)
        if t is not None:
            self.schedule(t, DFIN, w, w.version)

    # colocated workers ---------------------------------------------------------------
    def _colocate(self, w: ColocatedWorker, r: int, need: int, now: float) -> None:
        self.where[r] = w
        if w.reserve(need, self.cost):
            w.prompts.append([r, self.trace.inputs[r], self.trace.inputs[r]])
        else:
            w.queued.append(r)
        self.cluster.touch(w)
        if w.mixed_until is None:
            self._start_mixed(w, now)

    def _fill_prompts(self, w: ColocatedWorker, now: float) -> None:
        while w.queued:
            r = w.queued[0]
            if not w.reserve(
                self.cost.blocks(self.trace.inputs[r] + self.trace.outputs[r]), self.cost
            ):
                break
            w.queued.popleft()
            w.prompts.append([r, self.trace.inputs[r], self.trace.inputs[r]])
        if w.mixed_until is None and w.prompts:
            self._start_mixed(w, now)

    def _start_mixed(self, w: ColocatedWorker, now: float) -> None:
        if not w.prompts:
            return
        self.schedule(w.start_mixed(now, self.cost), MIXED, w, 0)
        t = w.next_finish_s()
        if t is not None:
            self.schedule(t, DFIN, w, w.version)

    def _mixed(self, w: ColocatedWorker, now: float) -> None:
        if w.mixed_until != now:
            return
        w.advance(now)
        w.mixed_until = None
        for r in w.mixed_done:
            self.first_s[r] = now
            self._admit(w, r, now)
        w.mixed_done = []
        for r in w.pop_finished():
            self._finish(w, r, now)
        self._fill_prompts(w, now)
        if w.mixed_until is None:
            self._retime(w)
