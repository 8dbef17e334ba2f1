"""What both worker roles check and convert at their gRPC edge, as plain data.

The engine imports no protobuf (design rule), so these speak in field mappings named like the
worker API's messages; each role's edge builds its message from them in one line, e.g.
``common_pb2.TokenChunk(**chunk_fields(out))``. Sampling parameters come the other way through
:meth:`engine.sampling_params.SamplingParams.from_fields`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.outputs import StepOutput

MAX_REQUEST_ID_CHARS = 200


def check_request_id(request_id: str) -> str:
    """``request_id`` if it is 1..200 printable characters, else ValueError."""
    if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise ValueError(
            f"request_id must be 1..{MAX_REQUEST_ID_CHARS} printable characters, got "
            f"{request_id[:40]!r} ({len(request_id)} characters)"
        )
    return request_id


def check_prompt(token_ids: Sequence[int]) -> list[int]:
    """The prompt as a list; the engine checks the vocabulary range and the context length."""
    if not token_ids:
        raise ValueError("prompt_token_ids is empty: give at least one token id")
    return list(token_ids)


def chunk_fields(out: StepOutput) -> dict[str, Any]:
    """A step's output as the fields of a ``TokenChunk`` (``finish_reason`` "" = running)."""
    return {
        "index": out.index,
        "token_ids": out.token_ids,
        "text": out.text,
        "logprobs": [
            {
                "token_id": lp.token_id,
                "logprob": lp.logprob,
                "top_token_ids": [t for t, _ in lp.top],
                "top_logprobs": [p for _, p in lp.top],
            }
            for lp in out.logprobs
        ],
        "finish_reason": out.finish_reason or "",
    }
