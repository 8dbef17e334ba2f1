"""A reference, not a policy one could deploy: every 10 s it sizes both pools for the rate
the trace is drawn at right now (known exactly, not measured or forecast), at 80% busy,
in one step; removed workers drain. New workers still take their start-up time, so it
shows what a purely reactive autoscaler could reach at best on a trace."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.bench.autoscale_sim.engine import Action, Simulation
from pdserve.bench.autoscale_sim.workers import READY, STARTING


class OracleAutoscaler:
    name = "reactive oracle (knows the rate)"

    def __init__(self, needed: Callable[[float], tuple[int, int]], interval_s: float = 10.0):
        self.needed, self.interval_s = needed, interval_s

    def decide(self, now: float, sim: Simulation) -> list[Action]:
        prefill, decode = self.needed(now)
        return [_to(sim, "prefill", prefill), _to(sim, "decode", decode)]


def _to(sim: Simulation, role: str, target: int) -> Action:
    active = [w for w in sim.cluster.pools[role] if w.state in (STARTING, READY)]
    if target >= len(active):
        return Action(role, start=target - len(active))
    newest = sorted(active, key=lambda w: (w.state == READY, -w.ordered_s))
    return Action(role, remove=tuple(w.worker_id for w in newest[: len(active) - target]))
