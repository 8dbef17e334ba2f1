"""The Generate RPC (colocated serving): both phases of a request on this worker."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from engine.async_engine import AsyncEngine
from pdserve_proto import common_pb2, worker_pb2
from prefill_worker.convert import (
    check_request_id,
    params_from_proto,
    prompt_from_proto,
    step_to_chunk,
)

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
        prompt = prompt_from_proto(request.prompt_token_ids)
        started_s = time.monotonic()
        num_tokens = 0
        reasons: list[str] = []
        async for out in self.engine.generate(request_id, prompt, params):
            num_tokens += len(out.token_ids)
            if out.finish_reason is not None:
                reasons.append(out.finish_reason)
            yield step_to_chunk(out)
        log.info(
            "generate %s: %d prompt tokens, %d generated in %.3fs, finish %s",
            request_id,
            len(prompt),
            num_tokens,
            time.monotonic() - started_s,
            ",".join(reasons),
        )
