"""The default: choose (prefill, decode) together, minimising the predicted TTFT."""

from __future__ import annotations

from pdserve.router.policies.base import PoolPolicy
from pdserve.router.policies.cost import (
    Pools,
    TtftEstimate,
    choose_fetch,
    describe,
    load_key,
    predict_ttft,
)
from pdserve.router.policies.types import (
    CostModel,
    PeerFetch,
    RouteDecision,
    RouteRequest,
    WorkerCandidate,
)


class JointTtftPolicy(PoolPolicy):
    """Ranks every (prefill, decode) pair, or every colocated worker, by predicted TTFT.

    TTFT = queue wait + loading cached blocks from below the pool + uncached prefill tokens
    x per-token cost + KV bytes to move over the link / link bandwidth + decode admission
    (see ``predict_ttft``). A prefix hit on a busy worker thus wins only while its saved
    prefill time exceeds its extra queue wait.

    Disaggregated, a prefill worker may first fetch a longer prefix that another prefill
    worker holds (``choose_fetch``), when moving it beats computing it: an idle worker
    without the prefix then beats a busy holder once the holder's queue outlasts the fetch.
    """

    name = "joint_ttft"

    def __init__(
        self, cost: CostModel | None = None, max_decisions: int = 16, peer_fetch: bool = True
    ) -> None:
        if max_decisions < 1:
            raise ValueError(f"max_decisions must be >= 1, got {max_decisions}")
        super().__init__(cost)
        # Only the head of the ranking is ever walked (a few refusals or failures), so the
        # decisions and their reason strings are built for that head only.
        self._max_decisions = max_decisions
        self._peer_fetch = peer_fetch

    def rank_pools(self, request: RouteRequest, pools: Pools) -> list[RouteDecision]:
        scored = [
            (predict_ttft(request, p, d, self._cost, fetch, holder), p, d, fetch)
            for p, holder, fetch in self._prompt_options(request, pools)
            for d in (pools.decode or (None,))
        ]
        scored.sort(key=lambda s: (s[0].total_s, load_key(s[1]), _decode_key(s[2])))
        head = scored[: self._max_decisions]
        return [self._decision(request, est, p, d, fetch) for est, p, d, fetch in head]

    def _prompt_options(
        self, request: RouteRequest, pools: Pools
    ) -> list[tuple[WorkerCandidate, WorkerCandidate | None, PeerFetch | None]]:
        """Each prompt worker with the peer fetch it would make (prefill workers only)."""
        if not pools.disaggregated:
            return [(w, None, None) for w in pools.colocated]
        by_id = {w.worker_id: w for w in pools.prefill}
        options = []
        for p in pools.prefill:
            fetch = None
            if self._peer_fetch:
                fetch = choose_fetch(request, p, pools.prefill, self._cost)
            holder = by_id[fetch.holder_id] if fetch is not None else None
            options.append((p, holder, fetch))
        return options

    def _decision(
        self,
        request: RouteRequest,
        est: TtftEstimate,
        prefill: WorkerCandidate,
        decode: WorkerCandidate | None,
        fetch: PeerFetch | None,
    ) -> RouteDecision:
        parts = f"queue {est.queue_s:.4f}s"
        if est.load_s:
            parts += f" + tier loads {est.load_s:.4f}s"
        if fetch is not None:
            parts += f" + fetch {fetch.num_blocks} blocks from {fetch.holder_id} {est.fetch_s:.4f}s"
        parts += f" + prefill {est.prefill_s:.4f}s"
        if decode is None:
            where = f"colocated {describe(request, prefill)}"
        else:
            where = f"prefill {describe(request, prefill)}, decode {describe(request, decode)}"
            parts += f" + transfer {est.transfer_s:.4f}s + admission {est.admission_s:.4f}s"
        decode_id = decode.worker_id if decode is not None else None
        reason = f"{self.name}: {where}; predicted {parts}"
        return RouteDecision(
            prefill.worker_id, decode_id, est.total_s, self.name, reason, fetch,
            est.compute_tokens, est.queue_s,
        )  # fmt: skip


def _decode_key(decode: WorkerCandidate | None) -> tuple[int, int, int, str]:
    return load_key(decode) if decode is not None else (0, 0, 0, "")
