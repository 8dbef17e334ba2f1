"""Simulated workers: aggregate state, no per-token events.

A prefill worker runs prompts FCFS: each prompt's finish time is known when it is queued.
A decode worker runs a continuous batch as a fluid: ``steps`` grows at one per step time
(which depends on the batch), and a sequence admitted at ``steps = s`` with ``k`` tokens
left finishes when ``steps`` reaches ``s + k``. Only admissions and finishes are events.
A colocated worker adds DistServe's simple interference model: while prompts wait, each
step is a mixed step that takes the prefill chunks' time plus the decode rows' time.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from pdserve.bench.autoscale_sim.model import CostModel

STARTING, READY, DRAINING, STOPPED = "starting", "ready", "draining", "stopped"


@dataclass(slots=True)
class Worker:
    """What every worker has: identity, lifecycle times and the peaks an autoscaler reads."""

    worker_id: str
    role: str
    ordered_s: float
    state: str = STARTING
    ready_s: float = 0.0
    stop_s: float | None = None
    kv_peak: float = 0.0  # highest KV usage since the last reset (WVA's max_over_time)
    queue_peak: int = 0

    @property
    def routable(self) -> bool:
        return self.state == READY


@dataclass(slots=True)
class PrefillWorker(Worker):
    """FCFS prompts: ``jobs`` holds (start, finish, request, tokens), oldest first."""

    busy_until: float = 0.0
    jobs: deque[tuple[float, float, int, int]] = field(default_factory=deque)
    queued_tokens: int = 0

    def enqueue(self, now: float, request: int, tokens: int, seconds: float) -> float:
        start = max(now, self.busy_until)
        self.busy_until = start + seconds
        self.jobs.append((start, self.busy_until, request, tokens))
        self.queued_tokens += tokens
        self.queue_peak = max(self.queue_peak, self.waiting(now))
        return self.busy_until

    def prune(self, now: float) -> None:
        jobs = self.jobs
        while jobs and jobs[0][1] <= now:
            self.queued_tokens -= jobs.popleft()[3]

    def waiting(self, now: float) -> int:
        self.prune(now)
        return sum(1 for start, _, _, _ in self.jobs if start > now)

    def running(self, now: float) -> int:
        self.prune(now)
        return 1 if self.jobs and self.jobs[0][0] <= now else 0

    def kv_usage(self, now: float, cost: CostModel) -> float:
        """The prompt being prefilled holds its blocks; queued prompts hold none."""
        self.prune(now)
        if not self.jobs or self.jobs[0][0] > now:
            return 0.0
        return min(1.0, cost.blocks(self.jobs[0][3]) / cost.kv_blocks)


@dataclass(slots=True)
class DecodeWorker(Worker):
    """A continuous batch. ``reserved`` blocks cover pending (KV on its way), waiting (no
    batch slot yet) and running sequences; ``ends`` is a heap of (end step, request)."""

    reserved: int = 0
    pending: int = 0
    running: int = 0
    context_sum: float = 0.0
    steps: float = 0.0
    last_s: float = 0.0
    step_s: float = 0.0
    version: int = 0
    ends: list[tuple[float, int]] = field(default_factory=list)
    waiting: deque[int] = field(default_factory=deque)
    pending_ids: set[int] = field(default_factory=set)

    def free_blocks(self, cost: CostModel) -> int:
        return cost.kv_blocks - self.reserved

    def kv_usage(self, cost: CostModel) -> float:
        return self.reserved / cost.kv_blocks

    def reserve(self, blocks: int, cost: CostModel) -> bool:
        if self.reserved + blocks > cost.kv_blocks:
            return False
        self.reserved += blocks
        self.kv_peak = max(self.kv_peak, self.reserved / cost.kv_blocks)
        return True

    def advance(self, now: float) -> None:
        if self.running and self.step_s > 0:
            self.steps += (now - self.last_s) / self.step_s
        self.last_s = now

    def admit(self, now: float, request: int, steps_left: int, context: float) -> None:
        """Into the batch at ``now`` (call :meth:`advance` first)."""
        heapq.heappush(self.ends, (self.steps + steps_left, request))
        self.running += 1
        self.context_sum += context

    def pop_finished(self) -> list[int]:
        """Requests whose last step is done (after :meth:`advance`)."""
        done: list[int] = []
        ends = self.ends
        while ends and ends[0][0] <= self.steps + 1e-9:
            done.append(heapq.heappop(ends)[1])
        return done

    def retime(self, cost: CostModel) -> float | None:
        """Set the step time for the batch now; the next finish time, or None."""
        self.version += 1
        self.step_s = cost.decode_step_s(self.running, self.context_sum)
        return self.next_finish_s()

    def next_finish_s(self) -> float | None:
        if not self.ends or self.step_s <= 0:
            return None
        return self.last_s + max(0.0, self.ends[0][0] - self.steps) * self.step_s

    @property
    def idle(self) -> bool:
        return not (self.running or self.pending or self.waiting or self.reserved)


@dataclass(slots=True)
class ColocatedWorker(DecodeWorker):
    """A decode batch plus prompts: ``prompts`` holds [request, tokens left, prompt tokens]
    with KV reserved; ``queued`` the requests still waiting for KV room."""

    prompts: deque[list[int]] = field(default_factory=deque)
    queued: deque[int] = field(default_factory=deque)
    mixed_until: float | None = None
    mixed_done: list[int] = field(default_factory=list)

    def queued_prompt_tokens(self) -> int:
        return sum(p[1] for p in self.prompts)

    def start_mixed(self, now: float, cost: CostModel) -> float:
        """Start a mixed step: decode tokens first, then prompt chunks FCFS up to the token
        budget. Returns its end; the prompts it completes are in ``mixed_done``."""
        self.advance(now)
        budget = max(1, cost.max_num_batched_tokens - self.running)
        # The step's fixed cost is in the prefill time already (it was measured as a TTFT).
        seconds = max(0.0, cost.decode_step_s(self.running, self.context_sum) - cost.decode_base_s)
        done: list[int] = []
        for prompt in self.prompts:
            if budget <= 0:
                break
            chunk = min(budget, prompt[1])
            seconds += cost.prefill_s(chunk, prompt[2])
            prompt[1] -= chunk
            budget -= chunk
            if prompt[1] == 0:
                done.append(prompt[0])
        while self.prompts and self.prompts[0][1] == 0:
            self.prompts.popleft()
        self.mixed_done = done
        self.mixed_until = now + seconds
        self.version += 1
        self.step_s = seconds
        return self.mixed_until

    def retime(self, cost: CostModel) -> float | None:
        if self.mixed_until is not None:  # a mixed step keeps its length to its end
            self.version += 1
            return self.next_finish_s()
        return DecodeWorker.retime(self, cost)

    @property
    def idle(self) -> bool:
        busy = self.running or self.pending or self.waiting or self.reserved
        return not (busy or self.prompts or self.queued)
