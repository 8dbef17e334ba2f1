"""Counting event-loop ticks: evidence that the loop kept running while a call waited."""

from __future__ import annotations

import asyncio
from types import TracebackType


class LoopTicks:
    """``async with LoopTicks() as ticks:`` counts ``ticks.count`` wake-ups of a task that
    sleeps ``period_s`` between them; a blocked loop stops the count."""

    def __init__(self, period_s: float = 0.001) -> None:
        self.period_s = period_s
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopTicks:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _run(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(self.period_s)
