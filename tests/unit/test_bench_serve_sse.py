"""SSE decoding and OpenAI stream chunk reading."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.serve.sse import DONE, SSEDecoder, parse_chunk


def _decode(lines: list[str]) -> list[str]:
    decoder = SSEDecoder()
    events = [data for line in lines if (data := decoder.feed(line)) is not None]
    tail = decoder.flush()
    return [*events, tail] if tail is not None else events


def test_events_are_split_on_blank_lines() -> None:
    assert _decode(['data: {"a":1}', "", "data: [DONE]", ""]) == ['{"a":1}', DONE]


def test_multi_line_data_comments_fields_and_crlf() -> None:
    lines = [": keep-alive", "event: message", "id: 7", "data: one\r", "data:two", "\r", ""]
    assert _decode(lines) == ["one\ntwo"]


def test_only_one_leading_space_is_stripped_and_unterminated_event_flushes() -> None:
    assert _decode(["data:   spaced"]) == ["  spaced"]


def test_blank_lines_without_data_yield_nothing() -> None:
    assert _decode(["", "", ": comment", ""]) == []


def _chunk(**fields: object) -> str:
    return json.dumps({"id": "x", "object": "text_completion", **fields})


def test_completion_token_chunk() -> None:
    chunk = parse_chunk(_chunk(choices=[{"index": 0, "text": " hi", "finish_reason": None}]))
    assert chunk.is_token and chunk.text == " hi" and chunk.error is None


def test_empty_text_counts_while_open_but_not_as_a_closing_marker() -> None:
    partial = parse_chunk(_chunk(choices=[{"index": 0, "text": "", "finish_reason": None}]))
    closing = parse_chunk(_chunk(choices=[{"index": 0, "text": "", "finish_reason": "stop"}]))
    last = parse_chunk(_chunk(choices=[{"index": 0, "text": ".", "finish_reason": "length"}]))
    assert partial.is_token and not closing.is_token and last.is_token


def test_chat_chunks() -> None:
    role_only = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    first = {"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": None}
    later = {"index": 0, "delta": {"content": " there"}, "finish_reason": None}
    assert not parse_chunk(_chunk(choices=[role_only])).is_token
    assert parse_chunk(_chunk(choices=[first])).text == "Hi"
    assert parse_chunk(_chunk(choices=[later])).is_token


def test_usage_chunk() -> None:
    usage = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
    chunk = parse_chunk(_chunk(choices=[], usage=usage))
    assert not chunk.is_token
    assert (chunk.prompt_tokens, chunk.completion_tokens) == (12, 5)


def test_error_event() -> None:
    chunk = parse_chunk(json.dumps({"error": {"message": "worker lost", "type": "x"}}))
    assert chunk.error == "worker lost" and not chunk.is_token


def test_non_object_chunk_is_rejected() -> None:
    with pytest.raises(ValueError, match="not a JSON object"):
        parse_chunk("[1, 2]")
