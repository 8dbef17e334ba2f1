"""The event loop a router process runs on: uvloop when it is installed, else asyncio's.

The router's work per request is mostly event-loop work (gRPC completions, task wake-ups,
socket readiness); uvloop does that part in C. grpc.aio and uvicorn both run on it. The
choice belongs to whoever owns the process (``pdserve up``, bench/router_overhead.py), so
it is a function of its own rather than a ``RouterConfig`` field.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")
LoopKind = Literal["auto", "uvloop", "asyncio"]
LOOP_KINDS: tuple[LoopKind, ...] = ("auto", "uvloop", "asyncio")


def resolve(kind: LoopKind = "auto") -> Literal["uvloop", "asyncio"]:
    """The loop ``kind`` means here: ``auto`` is uvloop when importable; ``uvloop``
    insists on it (ValueError when it is not installed)."""
    if kind not in LOOP_KINDS:
        raise ValueError(f"event loop must be one of {list(LOOP_KINDS)}, got {kind!r}")
    if kind == "asyncio":
        return "asyncio"
    if importlib.util.find_spec("uvloop") is not None:
        return "uvloop"
    if kind == "uvloop":
        raise ValueError("event loop 'uvloop' asked for, but uvloop is not installed")
    return "asyncio"


def loop_factory(kind: LoopKind = "auto") -> Callable[[], asyncio.AbstractEventLoop]:
    """A new-loop factory for ``asyncio.Runner`` (see ``resolve``)."""
    if resolve(kind) == "asyncio":
        return asyncio.new_event_loop
    import uvloop  # lazily: an optional dependency

    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], kind: LoopKind = "auto") -> T:
    """``asyncio.run(main)`` on the loop ``kind`` picks."""
    with asyncio.Runner(loop_factory=loop_factory(kind)) as runner:
        return runner.run(main)
