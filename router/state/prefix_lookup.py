"""Asking the locality index how much of a prompt each worker already holds."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence

from pdserve.router.policies.types import PrefixHit
from pdserve.router.state.locality import BlockHash, LocalityIndex

log = logging.getLogger(__name__)


async def prefix_hits(
    index: LocalityIndex | None,
    block_hashes: Sequence[BlockHash],
    worker_ids: Sequence[str],
) -> dict[str, PrefixHit]:
    """Leading prompt blocks (``block_hashes``) cached per worker, and in which tiers;
    empty when unknown.

    The index may answer synchronously or with an awaitable (an asyncio Redis client).
    A failing index degrades routing to load-only rather than failing the request.
    """
    if index is None or not block_hashes:
        return {}
    try:
        answer = index.longest_prefix(block_hashes, worker_ids)
        if inspect.isawaitable(answer):
            answer = await answer
    except Exception as err:  # e.g. Redis down: route on load alone, and say so
        log.warning("locality index lookup failed, routing without it: %r", err)
        return {}
    return dict(answer)
