"""What every worker role checks at its gRPC edge before the engine sees a request."""

from __future__ import annotations

from collections.abc import Sequence

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
