"""The Generate RPC (colocated serving): both phases of a request on this worker."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from pdserve.engine.async_engine import AsyncEngine
from pdserve.proto import common_pb2, worker_pb2
from pdserve.proto.params import params_from_proto
from pdserve.worker.checks import check_prompt, check_request_id
from pdserve.worker.convert import step_to_chunk

log = logging.getLogger(__name__)


class GenerateService:
    """Streams whole requests; a caller that goes away aborts its request (KV freed)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def generate(
        self, request: worker_pb2.GenerateRequest
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        request_id = check_request_id(request.request_id)
        params = params_from_proto(request.params)
        prompt = check_prompt(request.prompt_token_ids)
        started_s = time.monotonic()
        num_tokens = 0
        reasons: list[str] = []
        clock = _PhaseClock(started_s)
        async for out in self.engine.generate(request_id, prompt, params):
            num_tokens += len(out.token_ids)
            if out.finish_reason is not None:
                reasons.append(out.finish_reason)
            yield clock.stamp(step_to_chunk(out))
        log.info(
            "generate %s: %d prompt tokens, %d generated in %.3fs, finish %s",
            request_id,
            len(prompt),
            num_tokens,
            time.monotonic() - started_s,
            ",".join(reasons),
        )


class _PhaseClock:
    """Puts a TTFT breakdown on a Generate stream: ``prefill_s`` on its first chunk,
    ``first_step_s`` (the step after the prefill) on its second."""

    def __init__(self, started_s: float) -> None:
        self._last_s = started_s
        self._chunks = 0

    def stamp(self, chunk: common_pb2.TokenChunk) -> common_pb2.TokenChunk:
        now_s = time.monotonic()
        if self._chunks == 0:
            chunk.phase_times.prefill_s = now_s - self._last_s
        elif self._chunks == 1:
            chunk.phase_times.first_step_s = now_s - self._last_s
        self._chunks += 1
        self._last_s = now_s
        return chunk
