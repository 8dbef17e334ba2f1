"""Which event loop a router process runs on (router/event_loop.py)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from pdserve.router.event_loop import resolve, run

HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_is_always_available() -> None:
    assert resolve("asyncio") == "asyncio"
    assert run(loop_module(), "asyncio").startswith("asyncio")


def test_auto_prefers_uvloop_when_installed() -> None:
    expected = "uvloop" if HAVE_UVLOOP else "asyncio"
    assert resolve("auto") == expected
    assert run(loop_module(), "auto").startswith(expected)


def test_unknown_loop_is_refused() -> None:
    with pytest.raises(ValueError, match="event loop must be one of"):
        resolve("trio")  # type: ignore[arg-type]
