"""Protobuf <-> internal dataclasses, done once at the edge."""

from __future__ import annotations

from functools import lru_cache

from engine.sampling_params import SamplingParams
from pdserve_proto import common_pb2
from router.request import ChunkEvent, TokenLogprob


def params_from_proto(msg: common_pb2.SamplingParams, default_max_tokens: int) -> SamplingParams:
    """Unset optional fields take the engine defaults; raises ValueError on bad values."""
    fields = {f.name: value for f, value in msg.ListFields()}
    return SamplingParams.from_fields(fields, default_max_tokens)


def params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop_token_ids=params.stop_token_ids,
        stop=params.stop,
        include_stop_str_in_output=params.include_stop_str_in_output,
        ignore_eos=params.ignore_eos,
        n=params.n,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


@lru_cache(maxsize=256)
def params_message(params: SamplingParams) -> common_pb2.SamplingParams:
    """``params_to_proto``, cached: requests mostly repeat a few parameter sets, and the
    router's edge shares one ``SamplingParams`` object per set (``router.params_cache``).

    The returned message is shared: callers copy it into their requests, never mutate it.
    """
    return params_to_proto(params)


def chunk_from_proto(msg: common_pb2.TokenChunk, index: int | None = None) -> ChunkEvent:
    """``index`` overrides the chunk's own (fan-out sub-requests are all index 0)."""
    # This runs for every chunk the router relays: positional arguments, a slice (a list,
    # made in C) rather than iterating the repeated field, no generator without logprobs.
    logprobs = tuple(map(_logprob_from_proto, msg.logprobs)) if msg.logprobs else ()
    return ChunkEvent(
        msg.index if index is None else index,
        tuple(msg.token_ids[:]),
        msg.text,
        logprobs,
        msg.finish_reason or None,
    )


def chunk_to_proto(chunk: ChunkEvent) -> common_pb2.TokenChunk:
    msg = common_pb2.TokenChunk()
    fill_chunk(msg, chunk)
    return msg


def fill_chunk(msg: common_pb2.TokenChunk, chunk: ChunkEvent) -> None:
    """Write ``chunk`` into an empty ``msg`` in place (e.g. a response's ``chunk`` field,
    which saves building a message and copying it). Default values are left unset."""
    msg.SetInParent()  # a chunk of defaults only is still a chunk: the field is present
    if chunk.index:
        msg.index = chunk.index
    msg.token_ids.extend(chunk.token_ids)
    if chunk.text:
        msg.text = chunk.text
    if chunk.logprobs:
        msg.logprobs.extend(map(_logprob_to_proto, chunk.logprobs))
    if chunk.finish_reason:
        msg.finish_reason = chunk.finish_reason


def _logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    top = tuple(zip(msg.top_token_ids, msg.top_logprobs, strict=False))
    return TokenLogprob(token_id=msg.token_id, logprob=msg.logprob, top=top)


def _logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_token_ids=[t for t, _ in lp.top],
        top_logprobs=[p for _, p in lp.top],
    )
