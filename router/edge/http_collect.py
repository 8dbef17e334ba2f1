"""Reading a whole (non-streamed) answer while watching for the client to hang up."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from starlette.requests import Request

from pdserve.router.request.types import ChunkEvent, Summary


class ClientDisconnectedError(Exception):
    pass


@dataclass(slots=True, frozen=True)
class Collected:
    chunks: tuple[ChunkEvent, ...]
    summary: Summary


async def collect_until_disconnect(
    events: AsyncGenerator[ChunkEvent | Summary, None], request: Request
) -> Collected:
    """All events of a request; if the client disconnects first, close the request.

    Closing the event stream cancels the worker calls and sends Cancel, freeing their KV.
    """
    collecting = asyncio.ensure_future(_collect(events))
    disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait(
            (collecting, disconnected), return_when=asyncio.FIRST_COMPLETED
        )
    except BaseException:
        collecting.cancel()
        raise
    finally:
        disconnected.cancel()
    if collecting in done:
        return collecting.result()
    collecting.cancel()
    await asyncio.gather(collecting, return_exceptions=True)  # it closes the request
    raise ClientDisconnectedError(f"client {request.client} went away")


async def _collect(events: AsyncGenerator[ChunkEvent | Summary, None]) -> Collected:
    chunks: list[ChunkEvent] = []
    try:
        async for event in events:
            if isinstance(event, Summary):
                return Collected(tuple(chunks), event)
            chunks.append(event)
    finally:
        await events.aclose()
    raise AssertionError("the event stream ended without a Summary")


async def _wait_for_disconnect(request: Request) -> None:
    # The body was read already, so the next message is the disconnect (or never comes).
    while (await request.receive())["type"] != "http.disconnect":
        pass
