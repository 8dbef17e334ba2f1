"""Failover policy (router/request/failover.py) and the router's text after a failover
(router/request/failover_text.py): what is replayed, when the router gives up, and that the client's
text equals the uninterrupted text across a break."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.request.failover import (
    STREAM_ENDED,
    FailoverConfig,
    Refusal,
    ReplayPlan,
    SequenceStream,
    StreamBreak,
)
from pdserve.router.request.failover_text import TextContinuation, TextDecoder
from pdserve.router.request.types import ChunkEvent, TokenLogprob

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = (1, 104, 105)  # BOS, "h", "i"
CONFIG = FailoverConfig()
BROKEN = StreamBreak("d0", "UNAVAILABLE", "Socket closed")


class CharDecoder:
    """A FAKE tokenizer's decode: token id = code point; ids <= 2 are special (skipped)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids if i > 2)


class ByteDecoder:
    """A FAKE byte-level tokenizer: token id = one UTF-8 byte."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def chunk(
    text_of_token: str, sent_text: str | None = None, finish: str | None = None
) -> ChunkEvent:
    """One token (a character) as a worker sends it: ``sent_text`` is what it let out."""
    sent = text_of_token if sent_text is None else sent_text
    return ChunkEvent(0, (ord(text_of_token),), sent, finish_reason=finish)


def sent(stream: SequenceStream, chunks: list[ChunkEvent]) -> list[ChunkEvent]:
    return [stream.deliver(c) for c in chunks]


def replay(
    stream: SequenceStream, brk: StreamBreak = BROKEN, decoder: TextDecoder | None = None
) -> ReplayPlan:
    plan = stream.fail_over(brk, CONFIG, decoder or CharDecoder())
    assert isinstance(plan, ReplayPlan), plan
    return plan


def test_replay_is_prompt_plus_sent_tokens_with_fewer_max_tokens() -> None:
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=42, stop=("END",), top_k=5)
    stream = SequenceStream(PROMPT, params)
    sent(stream, [chunk("a"), chunk("b"), chunk("c")])
    plan = replay(stream)
    assert plan.prompt_token_ids == (*PROMPT, ord("a"), ord("b"), ord("c"))
    assert plan.delivered_tokens == 3
    assert plan.params.max_tokens == 7
    assert (plan.params.temperature, plan.params.seed, plan.params.top_k) == (0.7, 42, 5)
    assert plan.params.stop == ()  # the router applies them from now on
    assert plan.params.prior_output_tokens == 3  # seeded draws and penalties continue
    assert (plan.failover, plan.exclude) == (1, "d0")


def test_the_second_replay_carries_every_token_sent_so_far() -> None:
    stream = SequenceStream(PROMPT, SamplingParams(max_tokens=10))
    sent(stream, [chunk("a"), chunk("b")])
    replay(stream)
    sent(stream, [chunk("c")])
    plan = replay(stream, StreamBreak("d1", STREAM_ENDED, "ended"))
    assert plan.prompt_token_ids == (*PROMPT, ord("a"), ord("b"), ord("c"))
    assert (plan.params.max_tokens, plan.failover, plan.exclude) == (7, 2, "d1")
    assert plan.params.prior_output_tokens == 3


def test_gives_up_after_max_failovers_naming_every_failure() -> None:
    stream = SequenceStream(PROMPT, SamplingParams(max_tokens=10))
    for worker_id in ("d0", "d1"):
        sent(stream, [chunk("a")])
        replay(stream, StreamBreak(worker_id, "UNAVAILABLE", f"{worker_id} gone"))
    sent(stream, [chunk("b")])
    refusal = stream.fail_over(StreamBreak("d2", "INTERNAL", "reset"), CONFIG, CharDecoder())
    assert isinstance(refusal, Refusal)
    assert "worker d2 (INTERNAL: reset) broke the stream after 3 of 10 tokens" in refusal.message
    assert "gave up after 2 failover(s)" in refusal.message
    assert "d0 gone" in refusal.message and "d1 gone" in refusal.message


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "UNAUTHENTICATED"])
def test_failures_another_worker_cannot_fix_are_not_replayed(code: str) -> None:
    stream = SequenceStream(PROMPT, SamplingParams(max_tokens=10))
    sent(stream, [chunk("a")])
    refusal = stream.fail_over(StreamBreak("d0", code, "no"), CONFIG, CharDecoder())
    assert isinstance(refusal, Refusal) and f"{code} is not a failure" in refusal.message
    assert stream.failovers == 0


def test_no_replay_for_n_above_one_nor_when_disabled() -> None:
    stream = SequenceStream(PROMPT, SamplingParams(max_tokens=10, n=2))
    sent(stream, [chunk("a")])
    refusal = stream.fail_over(BROKEN, CONFIG, CharDecoder())
    assert isinstance(refusal, Refusal) and "n=2" in refusal.message
    stream = SequenceStream(PROMPT, SamplingParams(max_tokens=10))
    sent(stream, [chunk("a")])
    refusal = stream.fail_over(BROKEN, FailoverConfig(max_failovers=0), CharDecoder())
    assert isinstance(refusal, Refusal) and "gave up after 0" in refusal.message
    with pytest.raises(ValueError, match="max_failovers must be >= 0, got -1"):
        FailoverConfig(max_failovers=-1)


def test_finished_counts_every_sequence() -> None:
    stream = SequenceStream(PROMPT, SamplingParams(max_tokens=2, n=2))
    stream.deliver(ChunkEvent(0, (97,), "a", finish_reason="length"))
    assert not stream.finished
    stream.deliver(ChunkEvent(1, (98,), "b", finish_reason="stop"))
    assert stream.finished


def test_without_a_tokenizer_only_a_clean_break_is_replayed() -> None:
    clean = SequenceStream(PROMPT, SamplingParams(max_tokens=10))
    sent(clean, [chunk("a"), chunk("b")])
    plan = clean.fail_over(BROKEN, CONFIG, decoder=None)
    assert isinstance(plan, ReplayPlan) and plan.params.max_tokens == 8
    assert clean.continuation is None  # the new worker's text goes out as it is
    held = SequenceStream(PROMPT, SamplingParams(max_tokens=10))
    sent(held, [chunk("a"), chunk("b", sent_text="")])  # the worker held "b" back
    refusal = held.fail_over(BROKEN, CONFIG, decoder=None)
    assert isinstance(refusal, Refusal) and "no tokenizer" in refusal.message
    stops = SequenceStream(PROMPT, SamplingParams(max_tokens=10, stop=("x",)))
    sent(stops, [chunk("a")])
    assert isinstance(stops.fail_over(BROKEN, CONFIG, decoder=None), Refusal)


def test_a_tokenizer_that_does_not_reproduce_the_sent_text_is_refused() -> None:
    stream = SequenceStream(PROMPT, SamplingParams(max_tokens=10))
    sent(stream, [chunk("a", sent_text=" w0")])  # not what CharDecoder makes of "a"
    refusal = stream.fail_over(BROKEN, CONFIG, CharDecoder())
    assert isinstance(refusal, Refusal) and "does not reproduce" in refusal.message
    assert "' w0'" in refusal.message


def test_stop_string_spanning_the_break_ends_the_stream_as_the_worker_would() -> None:
    output = "one two ENDthree"
    params = SamplingParams(max_tokens=20, stop=("END",))
    stream = SequenceStream(PROMPT, params)
    # The worker let out "one two " and held "E" back (it may start "END"), then died.
    sent(stream, [chunk(c) for c in "one two "] + [chunk("E", sent_text="")])
    replay(stream)
    out = sent(stream, [chunk("N"), chunk("D")])
    assert [c.text for c in out] == ["", ""]
    assert out[-1].finish_reason == "stop" and stream.finished_by_router
    assert stream.text == output.split("END")[0]
    assert len(stream.token_ids) == output.index("END") + len("END")


def test_tokens_after_the_stop_in_one_chunk_are_dropped() -> None:
    stream = SequenceStream(PROMPT, SamplingParams(max_tokens=20, stop=("ND",)))
    sent(stream, [chunk("a")])
    replay(stream)
    logprobs = tuple(TokenLogprob(t, -0.5) for t in (78, 68, 120))
    out = stream.deliver(ChunkEvent(0, (78, 68, 120), "NDx", logprobs))
    assert out.token_ids == (78, 68) and out.logprobs == logprobs[:2]
    assert (out.text, out.finish_reason) == ("", "stop")


def test_held_back_text_goes_out_when_it_is_no_stop_or_at_the_end() -> None:
    params = SamplingParams(max_tokens=4, stop=("EN",), include_stop_str_in_output=True)
    stream = SequenceStream(PROMPT, params)
    sent(stream, [chunk("a"), chunk("E", sent_text="")])
    replay(stream)
    assert stream.deliver(chunk("X")).text == "EX"  # "EX" is not a stop: both go out
    last = stream.deliver(chunk("E", finish="length"))  # held back, then flushed at the end
    assert (last.text, last.finish_reason) == ("E", "length")
    assert stream.text == "aEXE"


def test_include_stop_str_in_output_across_the_break() -> None:
    params = SamplingParams(max_tokens=9, stop=("EN",), include_stop_str_in_output=True)
    stream = SequenceStream(PROMPT, params)
    sent(stream, [chunk("a"), chunk("E", sent_text="")])
    replay(stream)
    out = stream.deliver(chunk("N"))
    assert (out.text, out.finish_reason, stream.text) == ("EN", "stop", "aEN")


def test_half_a_utf8_character_at_the_break_is_completed_by_the_router() -> None:
    output = "hé!".encode()  # "é" is two bytes: 0xC3 0xA9
    stream = SequenceStream(tuple(b"hi: "), SamplingParams(max_tokens=10))
    # The worker sent "h", then the byte 0xC3 with no text (half a character), then died.
    for token, text in ((output[0], "h"), (output[1], "")):
        stream.deliver(ChunkEvent(0, (token,), text))
    plan = replay(stream, decoder=ByteDecoder())
    assert plan.prompt_token_ids[-2:] == tuple(output[:2])
    for token in output[2:]:
        stream.deliver(ChunkEvent(0, (token,), "garbage from the new worker"))
    assert stream.text == output.decode()


def test_a_finish_without_a_token_flushes_what_was_held() -> None:
    cont = TextContinuation.resume(
        CharDecoder(), PROMPT, SamplingParams(stop=("EN",)), [ord("a"), ord("E")], "a"
    )
    assert isinstance(cont, TextContinuation)
    out = cont.rewrite(ChunkEvent(0, (), "", finish_reason="abort"))
    assert (out.text, out.finish_reason) == ("E", "abort")


def test_the_failover_modules_import_without_torch() -> None:
    probe = (
        "import sys; sys.modules['torch'] = None; sys.modules['grpc'] = None\n"
        "import pdserve.router.request.failover, pdserve.router.request.failover_text\n"
        "assert sys.modules.get('torch') is None and sys.modules.get('grpc') is None\n"
        "print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
