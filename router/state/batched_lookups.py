"""Locality lookups off the event loop, many requests' lookups per round trip.

A Redis-backed index answers synchronously over a socket. Called on the event loop, every
request's lookup would stop the router for a round trip (~0.13 ms on loopback) and, with
Redis hung rather than gone, for the client's whole socket timeout. ``BatchedLookups`` runs
them in a worker thread instead, one batch at a time: lookups that arrive while a batch is
out wait and leave together as the next batch, so under load one round trip serves many
requests. A lookup not answered within ``timeout_s`` gets an empty answer (route on load
alone) and the request goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from pdserve.engine.kv_cache.hashing import BlockHash
from pdserve.router.policies.types import PrefixHit

log = logging.getLogger(__name__)

Query = tuple[Sequence[BlockHash], Sequence[str]]  # (prompt block hashes, worker ids)
DEFAULT_TIMEOUT_S = 0.1


class BatchLocalityIndex(Protocol):
    def longest_prefix_many(self, queries: Sequence[Query]) -> list[dict[str, PrefixHit]]:
        """``longest_prefix`` of every query, in order, at once."""
        ...


class BatchedLookups:
    """A ``pdserve.router.state.locality.LocalityIndex`` whose ``longest_prefix`` is awaitable and
    batched.

    One per event loop (its futures belong to the loop that created the first batch).
    """

    def __init__(self, index: BatchLocalityIndex, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._index = index
        self.timeout_s = timeout_s
        self._waiting: list[tuple[Query, asyncio.Future[dict[str, PrefixHit]]]] = []
        self._sender: asyncio.Task[None] | None = None

    async def longest_prefix(
        self, block_hashes: Sequence[BlockHash], worker_ids: Sequence[str]
    ) -> dict[str, PrefixHit]:
        answer: asyncio.Future[dict[str, PrefixHit]] = asyncio.get_running_loop().create_future()
        self._waiting.append(((block_hashes, worker_ids), answer))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_batches())
        try:
            # shield: giving up on one answer must not cancel the batch it belongs to
            return await asyncio.wait_for(asyncio.shield(answer), self.timeout_s)
        except TimeoutError:
            return {}
        finally:
            # Timed out, or the request was cancelled: a batch not yet out leaves without it.
            answer.cancel()  # (a no-op once answered)

    async def _send_batches(self) -> None:
        while self._waiting:
            # Lookups that timed out already are not worth a round trip.
            batch = [(query, answer) for query, answer in self._waiting if not answer.done()]
            self._waiting = []
            if not batch:
                return
            try:
                answers = await asyncio.to_thread(
                    self._index.longest_prefix_many, [query for query, _ in batch]
                )
            except Exception as err:  # any index failure: these requests route on load alone
                log.warning("locality lookup failed, routing without it: %r", err)
                answers = [{} for _ in batch]
            for (_, answer), counts in zip(batch, answers, strict=True):
                if not answer.done():
                    answer.set_result(counts)
