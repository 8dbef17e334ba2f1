"""What a run records: per-second buckets of finished requests (the windows autoscalers read,
as the router's goodput windows publish them: by finish time, a refused attempt being a
failed request) and per-request outcomes."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.bench.autoscale_sim.model import Slo

# Fields of a one-second bucket.
(N, FAILED, GOOD, IN_TOK, OUT_TOK, TTFT_SUM, TTFT_OK, TPOT_SUM, TPOT_N, TPOT_OK, DUR_SUM,
 REFUSED_IN_TOK, REFUSED_OUT_TOK) = range(13)  # fmt: skip
_FIELDS = 13


@dataclass(frozen=True, slots=True)
class Window:
    """Requests finished in a window. Means are None without any finished request."""

    seconds: float
    requests: int
    failed: int
    request_rate: float
    mean_input: float
    mean_output: float
    ttft_mean: float | None
    ttft_attainment: float | None
    tpot_mean: float | None
    tpot_attainment: float | None
    duration_mean: float | None
    attainment: float | None
    refused_input_tokens: float = 0.0  # what the refused attempts asked for
    refused_output_tokens: float = 0.0


class Recorder:
    """Buckets by finish second and each request's outcome (by request id)."""

    def __init__(self, slo: Slo, requests: int, horizon_s: float) -> None:
        self.slo = slo
        self.buckets = [[0.0] * _FIELDS for _ in range(int(horizon_s) + 2)]
        self.good = bytearray(requests)
        self.ttft_ok = bytearray(requests)
        self.tpot_ok = bytearray(requests)
        self.finished = bytearray(requests)
        self.gave_up = bytearray(requests)
        self.ttft = [0.0] * requests
        self.tpot = [0.0] * requests
        self.failed = 0
        self.arrived = [[0, 0] for _ in range(len(self.buckets))]  # first attempts, tokens

    def arrival(self, now: float, input_tokens: int) -> None:
        a = self.arrived[min(int(now), len(self.arrived) - 1)]
        a[0] += 1
        a[1] += input_tokens

    def arrivals(self, now: float, seconds: float) -> tuple[float, float]:
        """(requests/s, mean prompt tokens) of the first attempts in the last ``seconds``:
        what the router sees at admission, before any refusal."""
        end = min(int(now), len(self.arrived))
        window = self.arrived[max(0, end - int(seconds)) : end]
        n = sum(a[0] for a in window)
        return n / max(1.0, float(len(window))), sum(a[1] for a in window) / n if n else 0.0

    def _bucket(self, now: float) -> list[float]:
        return self.buckets[min(int(now), len(self.buckets) - 1)]

    def finish(
        self,
        request: int,
        now: float,
        ttft: float,
        tpot: float | None,
        arrival: float,
        input_tokens: int,
        output_tokens: int,
    ) -> None:
        ttft_ok = ttft <= self.slo.ttft_s
        tpot_ok = tpot is None or tpot <= self.slo.tpot_s
        b = self._bucket(now)
        b[N] += 1
        b[IN_TOK] += input_tokens
        b[OUT_TOK] += output_tokens
        b[TTFT_SUM] += ttft
        b[TTFT_OK] += ttft_ok
        if tpot is not None:
            b[TPOT_SUM] += tpot
            b[TPOT_N] += 1
        b[TPOT_OK] += tpot_ok
        b[GOOD] += ttft_ok and tpot_ok
        b[DUR_SUM] += now - arrival
        self.good[request] = ttft_ok and tpot_ok
        self.ttft[request] = ttft
        self.tpot[request] = tpot or 0.0
        self.ttft_ok[request] = ttft_ok
        self.tpot_ok[request] = tpot_ok
        self.finished[request] = 1

    def refused(self, now: float, input_tokens: int, output_tokens: int) -> None:
        """An attempt the router answered with an error (429, or a stream broken by a
        removed worker): a failed sample in the windows that counts what it asked for, as
        the router records it."""
        b = self._bucket(now)
        b[N] += 1
        b[FAILED] += 1
        b[REFUSED_IN_TOK] += input_tokens
        b[REFUSED_OUT_TOK] += output_tokens

    def give_up(self, request: int) -> None:
        """The request's outcome: failed (its last attempt is already in the windows)."""
        self.finished[request] = self.gave_up[request] = 1
        self.failed += 1

    def served(self) -> list[int]:
        """The requests that finished with their tokens."""
        return [
            i
            for i, (f, g) in enumerate(zip(self.finished, self.gave_up, strict=True))
            if f and not g
        ]

    def window(self, now: float, seconds: float) -> Window:
        """The requests finished in the last ``seconds`` (whole buckets) before ``now``."""
        end = min(int(now), len(self.buckets))
        start = max(0, end - int(seconds))
        sums = [0.0] * _FIELDS
        for b in self.buckets[start:end]:
            for i in range(_FIELDS):
                sums[i] += b[i]
        span = max(1.0, float(end - start))
        n, served = int(sums[N]), sums[N] - sums[FAILED]
        return Window(
            seconds=span,
            requests=n,
            failed=int(sums[FAILED]),
            request_rate=n / span,
            mean_input=sums[IN_TOK] / served if served else 0.0,
            mean_output=sums[OUT_TOK] / served if served else 0.0,
            ttft_mean=sums[TTFT_SUM] / served if served else None,
            ttft_attainment=sums[TTFT_OK] / n if n else None,
            tpot_mean=sums[TPOT_SUM] / sums[TPOT_N] if sums[TPOT_N] else None,
            tpot_attainment=sums[TPOT_OK] / n if n else None,
            duration_mean=sums[DUR_SUM] / served if served else None,
            attainment=sums[GOOD] / n if n else None,
            refused_input_tokens=sums[REFUSED_IN_TOK],
            refused_output_tokens=sums[REFUSED_OUT_TOK],
        )


@dataclass(slots=True)
class RunResult:
    """One (trace, policy) run. ``series``: (time, prefill, decode provisioned, prefill,
    decode ready) every sample; ``minute_attainment``, ``minute_missed`` (requests that
    did not meet the SLO): by arrival minute; ``needed``:
    (time, prefill, decode) the pools the trace's rate needs at each sample."""

    trace: str
    policy: str
    requests: int
    good: int
    ttft_ok: int
    tpot_ok: int
    failed: int
    retried: int
    lost: int
    worker_hours: float
    peak: int
    peak_prefill: int
    peak_decode: int
    series: list[tuple[float, int, int, int, int]]
    minute_attainment: list[float | None]
    minute_missed: list[int]
    decisions: int
    decide_ms: float
    wall_s: float
    needed: list[tuple[float, int, int]] = field(default_factory=list)  # oracle sizes

    @property
    def attainment(self) -> float:
        return self.good / self.requests if self.requests else 1.0


def by_minute(
    arrivals: list[float], good: bytearray, minutes: int
) -> tuple[list[float | None], list[int]]:
    """Per arrival minute: the share of its requests that met the SLO, and how many did not."""
    total = [0] * minutes
    ok = [0] * minutes
    for t, g in zip(arrivals, good, strict=True):
        m = min(int(t // 60), minutes - 1)
        total[m] += 1
        ok[m] += g
    shares = [o / n if n else None for o, n in zip(ok, total, strict=True)]
    return shares, [n - o for o, n in zip(ok, total, strict=True)]
