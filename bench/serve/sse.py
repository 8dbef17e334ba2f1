"""Server-Sent Events decoding and OpenAI stream chunk reading.

An SSE event is a run of ``field: value`` lines ended by a blank line; its ``data`` lines are
joined with newlines. Lines starting with ``:`` are comments; other fields (``event``, ``id``,
``retry``) do not matter here. OpenAI streams end with the event ``data: [DONE]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


class SSEDecoder:
    """Feed it lines (without their line ending); it returns each event's data when complete."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """The finished event's data on a blank line that ends an event with data, else None."""
        line = line.rstrip("\r")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """The pending event's data (a stream may end without the final blank line)."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


@dataclass(slots=True, frozen=True)
class StreamChunk:
    """What one OpenAI stream chunk says: whether it carries a token (text) event, that text,
    the usage figures if it has them, and an error message if it is an error event."""

    is_token: bool
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


def parse_chunk(data: str) -> StreamChunk:
    """Read a completion or chat completion chunk (the JSON after ``data: ``)."""
    body = json.loads(data)
    if not isinstance(body, dict):
        raise ValueError(f"stream chunk is not a JSON object: {data[:200]!r}")
    if "error" in body:
        return StreamChunk(is_token=False, error=_error_message(body["error"]))
    usage = body.get("usage") or {}
    choices = body.get("choices") or []
    text, is_token = _choice_text(choices[0]) if choices else ("", False)
    return StreamChunk(
        is_token=is_token,
        text=text,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
    )


def _choice_text(choice: dict[str, Any]) -> tuple[str, bool]:
    # Completions carry "text"; chat completions carry "delta": {"content": ...}.
    open_choice = choice.get("finish_reason") is None
    if "delta" in choice:
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        # OpenAI opens a chat stream with a role-only delta: that is no token.
        return text, bool(text) or (open_choice and "role" not in delta)
    text = choice.get("text") or ""
    # A token whose text is still incomplete (part of a UTF-8 character) arrives as "",
    # and still counts; an empty chunk that only closes the choice does not.
    return text, bool(text) or open_choice


def _error_message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
