"""FCFS queue of sequences holding no blocks: new arrivals at the back, preempted at the front."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from pdserve.engine.scheduler.sequence import Sequence


class WaitingQueue:
    """A deque of sequences with removal by id (for aborts)."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)

    def push_back(self, seq: Sequence) -> None:
        self._queue.append(seq)

    def push_front(self, seq: Sequence) -> None:
        """Preempted and re-promoted sequences go first: they arrived before the rest."""
        self._queue.appendleft(seq)

    def peek(self) -> Sequence | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> Sequence:
        return self._queue.popleft()

    def remove(self, seq_id: str) -> Sequence | None:
        """Take the sequence out wherever it is; None if it is not queued."""
        for seq in self._queue:
            if seq.seq_id == seq_id:
                self._queue.remove(seq)
                return seq
        return None
