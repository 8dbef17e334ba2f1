"""The router's own text for a sequence it continues on another worker (pure; see failover.py).

A worker turns tokens into text with an incremental detokenizer and a stop-string matcher,
both of which hold text back (half a UTF-8 character; the start of what may become a stop
string). When the worker dies, that state dies with it, and a new worker starts from
nothing. :class:`TextContinuation` rebuilds the dead worker's state by feeding the delivered
tokens through the engine's own ``IncrementalDetokenizer`` and ``StopStringMatcher`` (from
the original prompt, as the worker did), then makes each later chunk's text exactly as
``LLMEngine._emit`` would have, one engine step per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stop_strings import StopStringMatcher
from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.router.request.types import ChunkEvent


class TextDecoder(Protocol):
    """Token ids to text, special tokens skipped: the router's tokenizer has this method."""

    def decode(self, ids: list[int]) -> str: ...


class _DecoderAsTokenizer(Tokenizer):
    """The engine's detokenizer calls ``decode(ids, skip_special_tokens)``; the router's
    tokenizer always skips special tokens, as the workers' detokenizers do."""

    def __init__(self, decoder: TextDecoder) -> None:
        super().__init__(hf_tokenizer=None)
        self._decoder = decoder

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._decoder.decode(list(token_ids))


class TextContinuation:
    """Detokenizer and stop strings of one sequence, continued by the router."""

    def __init__(
        self, decoder: TextDecoder, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._detok = IncrementalDetokenizer(_DecoderAsTokenizer(decoder), prompt_token_ids)
        self._stops = (
            StopStringMatcher(params.stop, params.include_stop_str_in_output)
            if params.stop
            else None
        )
        self.stopped = False  # a finish came from here (a stop string), not from the worker

    @classmethod
    def resume(
        cls,
        decoder: TextDecoder,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        sent_token_ids: Sequence[int],
        sent_text: str,
    ) -> TextContinuation | str:
        """The state the worker was in after sending ``sent_*``; a str says why there is none."""
        state = cls(decoder, prompt_token_ids, params)
        text = "".join(state._step(token, None)[0] for token in sent_token_ids)
        if state.stopped or text != sent_text:
            return (
                "the router's tokenizer does not reproduce the text sent so far (worker: "
                f"{sent_text[-40:]!r}, router: {text[-40:]!r}); does it belong to the "
                "workers' model?"
            )
        return state

    def rewrite(self, chunk: ChunkEvent) -> ChunkEvent:
        """``chunk`` with the text and finish the original worker would have sent.

        Tokens after a stop string the router found are dropped, as the engine would never
        have sampled them.
        """
        assert not self.stopped, "rewrite() after the router ended the sequence"
        steps: list[int | None] = list(chunk.token_ids) or [None]  # [None]: a finish alone
        texts: list[str] = []
        finish: str | None = None
        for i, token in enumerate(steps):
            text, finish = self._step(token, chunk.finish_reason if i == len(steps) - 1 else None)
            texts.append(text)
            if finish is not None:
                break
        used = len(texts)
        return replace(
            chunk,
            token_ids=chunk.token_ids[:used],
            text="".join(texts),
            logprobs=chunk.logprobs[:used],
            finish_reason=finish,
        )

    def _step(self, token: int | None, finish: str | None) -> tuple[str, str | None]:
        """One engine step's text and finish, made as ``LLMEngine._emit`` makes them."""
        text = self._detok.add(token) if token is not None else ""
        if finish is not None:
            text += self._detok.flush()
        if self._stops is None:
            return text, finish
        text = self._stops.feed(text)
        if self._stops.stopped and finish is None:
            finish = "stop"
            self.stopped = True
        elif finish is not None:
            text += self._stops.flush()
        return text, finish
