"""Continuing a request whose worker stream broke after the client saw tokens (pure policy).

When the stream that carries a request's tokens breaks (the worker was killed, the
connection reset, its KV was lost, the stream closed without a finish), the router does not
fail the request: it *replays* it on other workers. The replay's prompt is the original
prompt plus every token the client has been sent, its ``max_tokens`` is reduced by their
number, and it is routed afresh without the broken worker; its tokens go on into the same
client stream, so no token is lost or sent twice. A sequence fails over at most
``max_failovers`` times; then the request ends UNAVAILABLE, naming every failure::

    client:  t0 t1 t2 t3 |  t4 t5 ... tN           (one stream, no gap, no repeat)
    worker A: t0 t1 t2 t3 X  (UNAVAILABLE)
    worker B:   prompt' = prompt + [t0..t3], max_tokens' = max_tokens - 4  ->  t4 ... tN

What a replay reproduces, and what it does not:

- greedy decoding: the same tokens as an uninterrupted run;
- seeded sampling and presence/frequency penalties: the replay's ``prior_output_tokens``
  tells the worker that the delivered tokens at the end of its prompt are output, so its
  draws continue from the uninterrupted run's output count and its penalties count them:
  the same tokens as an uninterrupted run, as with greedy decoding;
- text: workers detokenize and apply stop strings with hold-back, and what a worker held back
  (half a UTF-8 character, the start of a possible stop string) dies with it. From the first
  failover on, the router makes the text itself (:class:`TextContinuation`) with the
  engine's own detokenizer and stop-string matcher, after checking that replaying the
  delivered tokens reproduces the text the client got; stop strings are taken off the
  replay's parameters (the router applies them and ends the stream). Without a tokenizer
  the router fails over only when nothing can be held back: no stop strings, and the last
  delivered token produced text.

Status codes arrive as gRPC code names (``"UNAVAILABLE"``), so this module needs no grpc.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.request.failover_text import TextContinuation, TextDecoder
from pdserve.router.request.types import ChunkEvent

STREAM_ENDED = "STREAM_ENDED"  # the stream closed cleanly but the sequence had not finished
# Failures another worker can fix: the worker or its connection is gone (UNAVAILABLE,
# CANCELLED by a stopping server, UNKNOWN/INTERNAL such as a reset stream), the KV it needed
# is gone (ABORTED transfer, FAILED_PRECONDITION lost reservation, RESOURCE_EXHAUSTED).
# Not listed, so not replayed: bad input, deadlines, auth, unimplemented calls.
FAILOVER_CODES = frozenset(
    {
        "UNAVAILABLE",
        "CANCELLED",
        "UNKNOWN",
        "INTERNAL",
        "ABORTED",
        "FAILED_PRECONDITION",
        "RESOURCE_EXHAUSTED",
        STREAM_ENDED,
    }
)


@dataclass(slots=True, frozen=True)
class FailoverConfig:
    """``max_failovers`` per sequence (0 disables failover); ``codes`` that allow one."""

    max_failovers: int = 2
    codes: frozenset[str] = FAILOVER_CODES

    def __post_init__(self) -> None:
        if self.max_failovers < 0:
            raise ValueError(f"max_failovers must be >= 0, got {self.max_failovers}")


@dataclass(slots=True, frozen=True)
class StreamBreak:
    """A worker stream that broke after the client had seen tokens."""

    worker_id: str
    code: str  # gRPC status code name, or STREAM_ENDED
    detail: str

    def describe(self) -> str:
        return f"worker {self.worker_id} ({self.code}: {self.detail})"


@dataclass(slots=True, frozen=True)
class ReplayPlan:
    """The request to run next: ``failover`` counts from 1; ``exclude`` the broken worker."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    delivered_tokens: int
    failover: int
    exclude: str


@dataclass(slots=True, frozen=True)
class Refusal:
    """Why the request cannot be continued; the client gets it as the error message."""

    message: str


@dataclass(slots=True)
class SequenceStream:
    """What the client has been sent for one request, and how to go on after a break.

    ``deliver`` every chunk before it goes out; ``fail_over`` when the stream breaks.
    ``token_ids`` and ``text`` are one sequence's for ``params.n == 1``, the only case that
    is replayed (a colocated n > 1 stream is not).
    """

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    last_text: str = ""  # text of the last chunk that carried tokens
    breaks: list[StreamBreak] = field(default_factory=list)
    continuation: TextContinuation | None = None
    unfinished: set[int] = field(default_factory=set)  # sequence indices still running

    def __post_init__(self) -> None:
        self.unfinished = set(range(self.params.n))

    @property
    def finished(self) -> bool:
        """Every sequence got its finish_reason: a break after this loses nothing."""
        return not self.unfinished

    @property
    def failovers(self) -> int:
        return len(self.breaks)

    @property
    def finished_by_router(self) -> bool:
        """The router's stop-string matcher ended the sequence: stop reading the worker."""
        return self.continuation is not None and self.continuation.stopped

    def deliver(self, chunk: ChunkEvent) -> ChunkEvent:
        """``chunk`` as the client gets it (its text remade by the router after a failover)."""
        if self.continuation is not None:
            chunk = self.continuation.rewrite(chunk)
        self.token_ids += chunk.token_ids
        self.text += chunk.text
        if chunk.token_ids:
            self.last_text = chunk.text
        if chunk.finish_reason is not None:
            self.unfinished.discard(chunk.index)
        return chunk

    def fail_over(
        self, brk: StreamBreak, config: FailoverConfig, decoder: TextDecoder | None
    ) -> ReplayPlan | Refusal:
        """The replay to run after ``brk``, or why there is none. On a plan, the stream
        counts the failover and (first time, with ``decoder``) takes over the text."""
        refusal = self._refusal(brk, config, decoder)
        if refusal is not None:
            return Refusal(f"{self._broke(brk)}; {refusal}")
        if decoder is not None and self.continuation is None:
            resumed = TextContinuation.resume(
                decoder, self.prompt_token_ids, self.params, self.token_ids, self.text
            )
            if isinstance(resumed, str):
                return Refusal(f"{self._broke(brk)}; {resumed}")
            self.continuation = resumed
        self.breaks.append(brk)
        return self._plan(brk, keep_stops=decoder is None)

    def _refusal(
        self, brk: StreamBreak, config: FailoverConfig, decoder: TextDecoder | None
    ) -> str | None:
        if brk.code not in config.codes:
            return f"{brk.code} is not a failure another worker can fix"
        if self.params.n != 1:
            return f"a stream of n={self.params.n} sequences cannot be replayed"
        if self.failovers >= config.max_failovers:
            return f"gave up after {self.failovers} failover(s): {self._history()}"
        if len(self.token_ids) >= self.params.max_tokens:
            return f"all {self.params.max_tokens} tokens were sent but no finish_reason"
        if decoder is None and (self.params.stop or not self.last_text):
            return (
                "the router has no tokenizer to continue text the worker held back "
                "(stop strings, or a token whose text was incomplete)"
            )
        return None

    def _plan(self, brk: StreamBreak, keep_stops: bool) -> ReplayPlan:
        delivered = len(self.token_ids)
        params = replace(
            self.params,
            max_tokens=self.params.max_tokens - delivered,
            stop=self.params.stop if keep_stops else (),
            prior_output_tokens=self.params.prior_output_tokens + delivered,
        )
        return ReplayPlan(
            prompt_token_ids=(*self.prompt_token_ids, *self.token_ids),
            params=params,
            delivered_tokens=delivered,
            failover=self.failovers,
            exclude=brk.worker_id,
        )

    def _broke(self, brk: StreamBreak) -> str:
        return (
            f"{brk.describe()} broke the stream after {len(self.token_ids)} of "
            f"{self.params.max_tokens} tokens"
        )

    def _history(self) -> str:
        return "; ".join(b.describe() for b in self.breaks)

    def failed_after_failover(self, error: BaseException) -> str:
        """The message when a replay found no worker to run on (or failed before a token)."""
        assert self.breaks, "failed_after_failover() before any failover"
        return (
            f"{self._history()} broke the stream after {len(self.token_ids)} of "
            f"{self.params.max_tokens} tokens, and failover {self.failovers} of the request "
            f"failed: {error}"
        )
