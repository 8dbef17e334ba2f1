"""What one request's lifecycle keeps as its events go out: timing, tokens, who watches.

``Progress`` measures TTFT, inter-chunk gaps and end-to-end time from the request's
arrival and marks the chunk that finishes the last sequence; a ``RequestWatch``
(router/request/metered_lifecycle.py) sees every event and how the request ended.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Protocol

from pdserve.router.request.types import ChunkEvent, RequestTiming, Summary


class RequestWatch(Protocol):
    """Follows one request: ``saw`` each event it sends, ``ended_by`` the exception that
    ended it (if one did), then ``closed``, always."""

    def saw(self, event: ChunkEvent | Summary) -> None: ...
    def ended_by(self, err: BaseException) -> None: ...
    def closed(self) -> None: ...


class Progress:
    """TTFT, inter-chunk gaps, end-to-end time and output tokens, from the request's
    arrival; which sequences still run (the chunk finishing the last one is ``is_last``)."""

    __slots__ = ("arrival_s", "completion_tokens", "first_s", "gaps_s", "last_s", "unfinished")

    def __init__(self, arrival_s: float, n: int) -> None:
        self.arrival_s = arrival_s
        self.first_s: float | None = None
        self.last_s = arrival_s
        self.gaps_s: list[float] = []
        self.unfinished = set(range(n))
        self.completion_tokens = 0

    def saw(self, chunk: ChunkEvent) -> ChunkEvent:
        """``chunk`` as it goes out to the client."""
        now = time.monotonic()
        if self.first_s is None:
            self.first_s = now
        else:
            self.gaps_s.append(now - self.last_s)
        self.last_s = now
        self.completion_tokens += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            self.unfinished.discard(chunk.index)
            if not self.unfinished:
                return replace(chunk, is_last=True)
        return chunk

    def timing(self, queue_s: float, transfer_s: float) -> RequestTiming:
        now = time.monotonic()
        first_s = self.first_s if self.first_s is not None else now
        return RequestTiming(
            ttft_s=first_s - self.arrival_s,
            e2e_s=now - self.arrival_s,
            queue_s=max(0.0, queue_s),
            transfer_s=transfer_s,
            itl_s=tuple(self.gaps_s),
        )
