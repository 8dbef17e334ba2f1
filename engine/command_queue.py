"""Callables handed from any thread to the one thread that owns an object, results back
through futures: how asyncio handlers reach the engine, which is not thread-safe.

::

    any thread:   future = queue.submit(fn) ──> SimpleQueue ──> owner: run_pending(wait_s)
                  future.result() / asyncio.wrap_future(future) <── fn()'s value or exception
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

T = TypeVar("T")
_STOP = object()  # the command that ends the owner's loop
_Command = tuple[Callable[[], Any], "concurrent.futures.Future[Any]"]


class CommandQueue:
    """Commands for one owner thread. ``submit`` and ``stop`` from any thread;
    ``run_pending`` and ``close`` from the owner only."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Command | object] = queue.SimpleQueue()
        self._closed = threading.Event()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue ``fn``; once the queue is closed the future fails at once with RuntimeError."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._closed.is_set():
            future.set_exception(RuntimeError("the engine thread has stopped"))
            return future
        self._queue.put((fn, future))
        return future

    def stop(self) -> None:
        """Ask the owner to stop: ``run_pending`` returns False when it reaches this."""
        self._queue.put(_STOP)

    def run_pending(self, wait_s: float | None) -> bool:
        """Run queued commands, waiting up to ``wait_s`` for the first (None: forever,
        0: not at all); False once told to stop."""
        try:
            item = self._queue.get(timeout=wait_s) if wait_s != 0.0 else self._queue.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is _STOP:
                return False
            fn, future = cast(_Command, item)
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # the caller gets it (ValueError: bad input)
                    future.set_exception(exc)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True

    def close(self, error: Exception) -> None:
        """Refuse new commands and fail the queued ones with ``error`` (the owner, at exit).

        Closed first, drained second: a command submitted meanwhile is either refused or
        still found by the drain, never left waiting forever.
        """
        self._closed.set()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                cast(_Command, item)[1].set_exception(error)
