"""The planner's attainment against its worker-hours, over its operating points, and where
each baseline stands against that frontier.

An operating point is the planner's target utilization (``PlannerConfig``: the share of a
replica's profiled capacity it sizes for) and its worker budget (each pool at most
``budget`` × its fixed-peak size; the default runs allow 2×). Target utilization cannot pass
1, so below the worker-hours of its run at 1.0 the frontier goes on with smaller budgets.

A baseline is judged at its own worker-hours: the planner's attainment there, read off the
frontier (linear between the two runs around it), and the best planner run that spent no
more; a run is what one could deploy, an interpolation is not.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

PLANNER_KEY = "planner"
DEFAULT_BUDGET = 2.0


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    """``hold_s``: how long the load must fit one replica fewer before a scale-in
    (``PlannerConfig.scale_down_sustain_s``; None: its default), which, held long, keeps
    the pools of the last burst as a reserve for the next."""

    target_utilization: float
    budget: float = DEFAULT_BUDGET
    hold_s: float | None = None

    @property
    def key(self) -> str:
        """The policy name on the command line: ``planner:u=0.9``, ``planner:u=1:b=0.5``,
        ``planner:u=0.8:hold=2400``."""
        budget = "" if self.budget == DEFAULT_BUDGET else f":b={self.budget:g}"
        hold = "" if self.hold_s is None else f":hold={self.hold_s:g}"
        return f"{PLANNER_KEY}:u={self.target_utilization:g}{budget}{hold}"

    @property
    def name(self) -> str:
        """The policy name in tables and plots."""
        budget = "" if self.budget == DEFAULT_BUDGET else f", pools ≤ {self.budget:g}× peak"
        hold = "" if self.hold_s is None else f", scale-in after {self.hold_s:g} s"
        return f"pdserve planner at {self.target_utilization:.0%}{budget}{hold}"

    @classmethod
    def parse(cls, key: str) -> OperatingPoint | None:
        """The point a policy key names, None if it names none; ValueError if malformed."""
        head, _, spec = key.partition(":")
        if head != PLANNER_KEY or not spec:
            return None
        fields = dict(part.split("=", 1) for part in spec.split(":") if "=" in part)
        if not set(fields) <= {"u", "b", "hold"} or "u" not in fields:
            raise ValueError(f"an operating point is planner:u=U[:b=B][:hold=S], got {key!r}")
        hold = fields.get("hold")
        return cls(
            float(fields["u"]),
            float(fields.get("b", DEFAULT_BUDGET)),
            None if hold is None else float(hold),
        )


@dataclass(frozen=True, slots=True)
class Run:
    """One run, as the frontier sees it."""

    policy: str
    worker_hours: float
    attainment: float


def pareto(runs: Sequence[Run]) -> list[Run]:
    """The runs no other run beats on both counts (at most as many worker-hours, higher
    attainment), by worker-hours."""
    frontier: list[Run] = []
    for run in sorted(runs, key=lambda r: (r.worker_hours, -r.attainment)):
        if not frontier or run.attainment > frontier[-1].attainment:
            frontier.append(run)
    return frontier


def attainment_at(frontier: Sequence[Run], worker_hours: float) -> float | None:
    """The frontier's attainment at ``worker_hours``: linear between the runs around it, the
    dearest run's beyond it, None below the cheapest run (the planner has no point there)."""
    hours = [r.worker_hours for r in frontier]
    if not frontier or worker_hours < hours[0]:
        return None
    i = bisect.bisect_right(hours, worker_hours)
    if i == len(frontier):
        return frontier[-1].attainment
    low, high = frontier[i - 1], frontier[i]
    share = (worker_hours - low.worker_hours) / (high.worker_hours - low.worker_hours)
    return low.attainment + share * (high.attainment - low.attainment)


def best_within(runs: Sequence[Run], worker_hours: float) -> Run | None:
    """The run of highest attainment among those spending at most ``worker_hours``."""
    within = [r for r in runs if r.worker_hours <= worker_hours]
    return max(within, key=lambda r: (r.attainment, -r.worker_hours), default=None)
