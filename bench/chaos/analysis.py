"""What a fault cost, from the requests' records (pure: no I/O, no clock).

Every figure is computed from :class:`Outcome` records the load generator kept, against the
tokens the same requests gave on a fault-free run:

- **failed** requests, counted by the status the client saw last;
- **exactness** of every stream that completed: its tokens aligned with the fault-free
  tokens (``difflib``), as tokens *lost* (missing), *repeated or extra* (inserted) and
  *changed* (replaced); all three must be 0;
- **goodput** (requests per second that completed within the SLO) in windows of
  ``window_s`` by *send* time: the arrivals are evenly spaced, so a window's count moves only
  when requests miss the SLO or fail, not with arrival noise. A request sent up to
  ``lead_s`` (the longest a request takes) before the fault may still run when it strikes,
  so *before* is the window that ends ``lead_s`` before the fault, *lowest* the worst window
  from there on, *after* the last window of the observation; *recovery* is the time from
  the fault to the first window from which goodput stays within 10% of before to the end of
  the observation (0 when it never left that band).
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

RECOVERED_SHARE = 0.9  # goodput within 10% of before


@dataclass(slots=True, frozen=True)
class Outcome:
    """One request as the client saw it (times in seconds on one monotonic clock)."""

    key: int  # which request of the dataset: its fault-free tokens are ``reference[key]``
    sent_s: float
    first_token_s: float | None
    done_s: float
    tokens: tuple[int, ...]
    status: str  # "ok", or the failure: "UNAVAILABLE", "DEADLINE_EXCEEDED", ...
    attempts: int = 1  # the client retries a request whose router went away

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(slots=True, frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met_by(self, o: Outcome) -> bool:
        if not o.ok or o.first_token_s is None:
            return False
        ttft = o.first_token_s - o.sent_s
        tpot = (o.done_s - o.first_token_s) / max(1, len(o.tokens) - 1)
        return ttft <= self.ttft_s and tpot <= self.tpot_s


@dataclass(slots=True, frozen=True)
class TokenErrors:
    lost: int = 0
    repeated: int = 0  # inserted: repeated or extra tokens
    changed: int = 0

    @property
    def total(self) -> int:
        return self.lost + self.repeated + self.changed

    def __add__(self, other: TokenErrors) -> TokenErrors:
        return TokenErrors(
            self.lost + other.lost, self.repeated + other.repeated, self.changed + other.changed
        )


def token_errors(tokens: Sequence[int], reference: Sequence[int]) -> TokenErrors:
    """How ``tokens`` differ from ``reference``, token by token."""
    lost = repeated = changed = 0
    matcher = difflib.SequenceMatcher(a=reference, b=tokens, autojunk=False)
    for op, a0, a1, b0, b1 in matcher.get_opcodes():
        if op == "delete":
            lost += a1 - a0
        elif op == "insert":
            repeated += b1 - b0
        elif op == "replace":
            common = min(a1 - a0, b1 - b0)
            changed += common
            lost += (a1 - a0) - common
            repeated += (b1 - b0) - common
    return TokenErrors(lost, repeated, changed)


@dataclass(slots=True, frozen=True)
class FaultReport:
    fault: str
    requests: int
    failed: dict[str, int]  # status -> count
    completed: int
    inexact_streams: int
    errors: TokenErrors
    retried: int  # requests the client had to send again
    admitted_attainment: float  # of the requests answered, the share within the SLO
    goodput_before: float
    goodput_lowest: float
    goodput_after: float
    recovery_s: float | None  # None: not back within the observation


def report(
    fault: str,
    outcomes: Sequence[Outcome],
    reference: Mapping[int, Sequence[int]],
    slo: Slo,
    fault_s: float,
    end_s: float,
    window_s: float,
    lead_s: float,
) -> FaultReport:
    """The fault injected at ``fault_s``; the requests sent from ``window_s + lead_s``
    before it until ``end_s``."""
    start_s = fault_s - lead_s - window_s
    window = [o for o in outcomes if start_s <= o.sent_s < end_s]
    failed = Counter(o.status for o in window if not o.ok)
    errors = TokenErrors()
    inexact = 0
    for o in window:
        if o.ok:
            e = token_errors(o.tokens, reference[o.key])
            errors += e
            inexact += e.total > 0
    series = goodput_series(window, slo, start_s, end_s, window_s)
    before = series[0][1] if series else 0.0
    after_fault = [(t, g) for t, g in series if t >= fault_s - lead_s]
    return FaultReport(
        fault=fault,
        requests=len(window),
        failed=dict(failed),
        completed=sum(o.ok for o in window),
        inexact_streams=inexact,
        errors=errors,
        retried=sum(o.attempts > 1 for o in window),
        admitted_attainment=sum(slo.met_by(o) for o in window) / max(1, sum(o.ok for o in window)),
        goodput_before=before,
        goodput_lowest=min((g for _, g in after_fault), default=before),
        goodput_after=after_fault[-1][1] if after_fault else before,
        recovery_s=recovery_time(after_fault, before, fault_s),
    )


def goodput_series(
    outcomes: Sequence[Outcome], slo: Slo, start_s: float, end_s: float, window_s: float
) -> list[tuple[float, float]]:
    """(window start, requests/s within the SLO) for windows sliding by a fifth of
    ``window_s`` over ``[start_s, end_s)``, attributed by send time."""
    met = sorted(o.sent_s for o in outcomes if slo.met_by(o))
    step = window_s / 5
    series = []
    t = start_s
    while t + window_s <= end_s + 1e-9:
        count = sum(1 for s in met if t <= s < t + window_s)
        series.append((t, count / window_s))
        t += step
    return series


def recovery_time(
    after_fault: Sequence[tuple[float, float]], before: float, fault_s: float
) -> float | None:
    """Seconds from the fault to the start of the first window from which every window holds
    ``RECOVERED_SHARE`` of ``before`` (0 when all do); None if the last one does not."""
    back: float | None = None
    for t, g in after_fault:
        if g < RECOVERED_SHARE * before:
            back = None
        elif back is None:
            back = t
    return None if back is None else max(0.0, back - fault_s)
