"""n > 1 on the disaggregated path: n one-sequence requests whose streams are merged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace
from typing import TypeVar

from pdserve.router.request.types import GenerateInput

T = TypeVar("T")
_DONE = object()


def fan_out_inputs(inp: GenerateInput) -> list[GenerateInput]:
    """Sequence i gets id ``<id>.i`` and, when a seed is given, seed + i (distinct samples)."""
    params = inp.params
    subs = []
    for i in range(params.n):
        seed = None if params.seed is None else (params.seed + i) % 2**64
        sub_params = replace(params, n=1, seed=seed)
        subs.append(replace(inp, request_id=f"{inp.request_id}.{i}", params=sub_params))
    return subs


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of all streams as they come, tagged with their stream's position.

    The first error of any stream is raised here; the other streams are then cancelled
    (which closes them, so each frees what it holds).
    """
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(i, s, queue)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(index: int, stream: AsyncIterator[T], queue: asyncio.Queue) -> None:
    try:
        async for item in stream:
            await queue.put((index, item))
    except Exception as err:  # handed to the consumer, which raises it
        await queue.put((index, err))
        return
    await queue.put((index, _DONE))
