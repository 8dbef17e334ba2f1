"""Where this router just sent prompts: the prefix cache a worker is about to hold (pure).

The locality index learns of a worker's blocks only once the worker has computed them and
published the event. Until then (a prefill, plus the publish interval) a second request
with the same prefix looks uncached everywhere and may go to another worker, which then
computes and caches the same prefix a second time: a burst on a new system prompt, or a
document's first questions, spreads one prefix over every worker. So the router remembers
for ``ttl_s`` which blocks it sent where, and routing takes the larger of that and the
index.

The same memory says how much *new* prefix (blocks no worker held) each worker was given
lately. Prefix-aware routing sends a prompt nobody holds to the worker given the least,
among equally loaded ones: new prefixes spread evenly over the workers, where the worker
id alone would pile every one of them on the first worker while the pool is idle, and
that worker's cache would then thrash while the others' stay empty.

No clock of its own: callers pass ``now_s`` (``time.monotonic()``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from pdserve.router.state.locality import BlockHash


class RecentPlacements:
    """Blocks sent to each worker within the last ``ttl_s``, and how many of them were new.

    At most ``max_blocks_per_worker`` are remembered per worker (the oldest go first), so
    a router with a long-prompt flood does not grow without bound.
    """

    def __init__(self, ttl_s: float = 30.0, max_blocks_per_worker: int = 65536) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_blocks_per_worker < 1:
            raise ValueError(f"max_blocks_per_worker must be >= 1, got {max_blocks_per_worker}")
        self.ttl_s = ttl_s
        self.max_blocks_per_worker = max_blocks_per_worker
        # worker -> block hash -> expiry, oldest expiry first
        self._blocks: dict[str, OrderedDict[BlockHash, float]] = {}
        # worker -> (expiry, new blocks) per placement, and their running sum
        self._fills: dict[str, deque[tuple[float, int]]] = {}
        self._fill_sums: dict[str, int] = {}

    def record(
        self, worker_id: str, block_hashes: Sequence[BlockHash], held: int, now_s: float
    ) -> None:
        """``block_hashes`` (a prompt's, in order) were sent to ``worker_id``, which held
        the first ``held`` of them already; the rest count as new prefix given to it."""
        expiry = now_s + self.ttl_s
        blocks = self._blocks.setdefault(worker_id, OrderedDict())
        for block_hash in block_hashes:
            blocks[block_hash] = expiry
            blocks.move_to_end(block_hash)
        while len(blocks) > self.max_blocks_per_worker:
            blocks.popitem(last=False)
        new = len(block_hashes) - min(held, len(block_hashes))
        if new:
            self._fills.setdefault(worker_id, deque()).append((expiry, new))
            self._fill_sums[worker_id] = self._fill_sums.get(worker_id, 0) + new

    def longest_prefix(
        self, block_hashes: Sequence[BlockHash], worker_ids: Sequence[str], now_s: float
    ) -> dict[str, int]:
        """Leading ``block_hashes`` sent to each worker within ``ttl_s`` (0 for others)."""
        out: dict[str, int] = {}
        for worker_id in worker_ids:
            self._expire(worker_id, now_s)
            blocks = self._blocks.get(worker_id)
            count = 0
            if blocks:
                for block_hash in block_hashes:  # chained hashes: the first miss ends it
                    if block_hash not in blocks:
                        break
                    count += 1
            out[worker_id] = count
        return out

    def new_blocks(self, worker_ids: Sequence[str], now_s: float) -> dict[str, int]:
        """New-prefix blocks given to each worker within ``ttl_s``."""
        for worker_id in worker_ids:
            self._expire(worker_id, now_s)
        return {w: self._fill_sums.get(w, 0) for w in worker_ids}

    def _expire(self, worker_id: str, now_s: float) -> None:
        blocks = self._blocks.get(worker_id)
        while blocks and next(iter(blocks.values())) <= now_s:
            blocks.popitem(last=False)
        fills = self._fills.get(worker_id)
        while fills and fills[0][0] <= now_s:
            self._fill_sums[worker_id] -= fills.popleft()[1]
