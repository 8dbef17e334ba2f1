"""Runs an :class:`LLMEngine` on its own thread, for asyncio servers.

::

    asyncio handlers ──(fn, future) on a thread-safe queue──> engine thread: run fn, step()
    per-request asyncio.Queue <──loop.call_soon_threadsafe─── StepOutputs of each step

The engine is not thread-safe, so every call into it (requests, role hooks, stats) runs on the
engine thread, between steps. The thread blocks on the queue only while nothing is left to step.
A caller that stops iterating a stream (closed or cancelled) aborts its request: KV freed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from pdserve.engine.command_queue import CommandQueue
from pdserve.engine.engine_stats import EngineStats, engine_stats
from pdserve.engine.output_sink import END, OutputSink
from pdserve.engine.outputs import StepOutput
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.kv_cache import ImportReservation

log = logging.getLogger(__name__)

T = TypeVar("T")
_STALLED_WAIT_S = 0.05

__all__ = ["AsyncEngine", "EngineStats"]


@dataclass(slots=True)
class _PendingAdmit:
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token: int


class AsyncEngine:
    """Thread-confined access to one engine. Bad input raises ValueError to the caller."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands = CommandQueue()
        self._sinks: dict[str, OutputSink] = {}
        self._pending: dict[str, _PendingAdmit] = {}
        self._prompt_tokens = 0  # counters behind EngineStats
        self._generated_tokens = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; open streams end with RuntimeError."""
        if self._thread.is_alive():
            self._commands.stop()
            self._thread.join(timeout_s)

    # -- requests ----------------------------------------------------------------------
    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[StepOutput]:
        """Stream a whole request (every sequence of ``params.n``) until it finishes."""
        prompt = list(prompt_token_ids)

        def open_request(sink: OutputSink) -> None:
            self.engine.add_request(request_id, prompt, params)
            self._register(request_id, sink, len(prompt))

        return self._stream(request_id, open_request, params.n)

    async def prefill(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> StepOutput:
        """Prefill role: the first token. The KV stays held until :meth:`release`.

        A result with ``finish_reason == "abort"`` means the request was cancelled meanwhile.
        """
        prompt = list(prompt_token_ids)

        def open_request(sink: OutputSink) -> None:
            self.engine.add_prefill_request(request_id, prompt, params)
            self._register(request_id, sink, len(prompt))

        stream = self._stream(request_id, open_request, 1, first_only=True)
        try:
            async for out in stream:
                return out
        finally:
            await stream.aclose()
        raise AssertionError(f"prefill {request_id!r} ended without a first output")

    def decode_imported(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        first_token: int,
    ) -> AsyncIterator[StepOutput]:
        """Decode role: continue a request whose prompt KV was imported (after
        :meth:`reserve_import` and a finished transfer) from ``first_token``."""
        prompt = list(prompt_token_ids)

        def open_request(sink: OutputSink) -> None:
            if not self.engine.admit_imported(request_id, prompt, params, first_token):
                self._pending[request_id] = _PendingAdmit(prompt, params, first_token)
            self._register(request_id, sink, len(prompt))

        return self._stream(request_id, open_request, 1)

    async def abort(self, request_id: str) -> bool:
        """Stop the request wherever it is and free its KV; its stream ends with "abort"."""
        return await self.run(lambda _engine: self._abort_now(request_id))

    # -- role hooks and inspection (run on the engine thread) --------------------------
    async def run(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; its result or exception."""
        future = self._commands.submit(lambda: fn(self.engine))
        return await asyncio.wrap_future(future)

    async def block_table(self, request_id: str) -> tuple[int, ...]:
        return await self.run(lambda e: e.block_table(request_id))

    async def release(self, request_id: str) -> bool:
        return await self.run(lambda e: e.release(request_id))

    async def reserve_import(
        self, request_id: str, prompt_token_ids: Sequence[int], record_hits: bool = True
    ) -> ImportReservation | None:
        prompt = list(prompt_token_ids)
        return await self.run(lambda e: e.reserve_import(request_id, prompt, record_hits))

    async def commit_import(self, request_id: str) -> None:
        await self.run(lambda e: e.commit_import(request_id))

    async def cancel_import(self, request_id: str) -> None:
        await self.run(lambda e: e.cancel_import(request_id))

    async def stats(self) -> EngineStats:
        return await self.run(lambda _engine: self._stats_now())

    # -- the loop side -----------------------------------------------------------------
    async def _stream(
        self,
        request_id: str,
        open_request: Callable[[OutputSink], None],
        n: int,
        first_only: bool = False,
    ) -> AsyncGenerator[StepOutput, None]:
        loop = asyncio.get_running_loop()
        sink = OutputSink(loop, asyncio.Queue(), set(range(n)), first_only)
        done = False
        try:
            await asyncio.wrap_future(self._commands.submit(lambda: open_request(sink)))
            while True:
                item = await sink.queue.get()
                if item is END:
                    done = True
                    return
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if first_only:
                    done = True  # from here on the caller owns the held KV
                yield item
        finally:
            if not done:
                self._commands.submit(lambda: self._drop(request_id, sink))

    # -- the engine thread -------------------------------------------------------------
    def _run(self) -> None:
        stalled = False
        try:
            while self._commands.run_pending(self._wait_s(stalled)):
                self._admit_pending()
                stalled = self.engine.has_unfinished() and not self._step()
        finally:
            error = RuntimeError("the engine thread has stopped")
            self._commands.close(error)
            self._fail_sinks(error)

    def _wait_s(self, stalled: bool) -> float | None:
        """How long to wait for a command: forever when idle, not at all while stepping.

        Stalled (work waits for blocks that only a command can free: a release, a cancel):
        a short wait instead of spinning on empty steps.
        """
        if stalled:
            return _STALLED_WAIT_S
        return 0.0 if self.engine.has_unfinished() or self._pending else None

    def _step(self) -> bool:
        """One engine step; False when nothing could run (no output, nothing running)."""
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing %d open requests", len(self._sinks))
            for request_id in list(self._sinks):
                self._sinks[request_id].put(exc)
                self._abort_now(request_id, notify=False)
            return True
        for out in outputs:
            self._deliver(out)
        return bool(outputs) or self.engine.scheduler.num_running > 0

    def _deliver(self, out: StepOutput) -> None:
        self._generated_tokens += len(out.token_ids)
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return  # aborted by a caller between the step and now
        sink.put(out)
        if out.finished or sink.first_only:
            sink.open_indices.discard(out.index)
        if not sink.open_indices or sink.first_only:
            del self._sinks[out.request_id]
            sink.end()

    def _register(self, request_id: str, sink: OutputSink, prompt_tokens: int) -> None:
        sink.opened = True
        self._sinks[request_id] = sink
        self._prompt_tokens += prompt_tokens

    def _admit_pending(self) -> None:
        for request_id, p in list(self._pending.items()):
            try:
                admitted = self.engine.admit_imported(
                    request_id, p.prompt_token_ids, p.params, p.first_token
                )
            except ValueError as exc:
                sink = self._sinks.get(request_id)
                if sink is not None:
                    sink.put(exc)
                self._abort_now(request_id, notify=False)
                continue
            if not admitted:
                return  # the running set is full: keep arrival order, retry after a step
            del self._pending[request_id]

    def _drop(self, request_id: str, sink: OutputSink) -> None:
        """The caller went away: free what its request holds (if it is still its own)."""
        current = self._sinks.get(request_id)
        mine = sink.opened and (current is sink or current is None)
        if mine and self._abort_now(request_id, notify=False):
            log.info("request %s: caller went away; aborted and freed its KV", request_id)

    def _abort_now(self, request_id: str, notify: bool = True) -> bool:
        found = self.engine.abort(request_id)
        found = self.engine.release(request_id) or found
        if self._pending.pop(request_id, None) is not None:
            self.engine.cancel_import(request_id)
            found = True
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            found = True
            if notify:
                for index in sorted(sink.open_indices):
                    sink.put(StepOutput(request_id, index, (), "", (), "abort"))
            sink.end()
        return found

    def _fail_sinks(self, error: Exception) -> None:
        for sink in self._sinks.values():
            sink.put(error)
        self._sinks.clear()

    def _stats_now(self) -> EngineStats:
        return engine_stats(
            self.engine, len(self._pending), self._prompt_tokens, self._generated_tokens
        )
