"""Protobuf <-> internal dataclasses, done once at the edge."""

from __future__ import annotations

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


def chunk_from_proto(msg: common_pb2.TokenChunk, index: int | None = None) -> ChunkEvent:
    """``index`` overrides the chunk's own (fan-out sub-requests are all index 0)."""
    return ChunkEvent(
        index=msg.index if index is None else index,
        token_ids=tuple(msg.token_ids),
        text=msg.text,
        logprobs=tuple(_logprob_from_proto(lp) for lp in msg.logprobs),
        finish_reason=msg.finish_reason or None,
    )


def chunk_to_proto(chunk: ChunkEvent) -> common_pb2.TokenChunk:
    return common_pb2.TokenChunk(
        index=chunk.index,
        token_ids=chunk.token_ids,
        text=chunk.text,
        logprobs=[_logprob_to_proto(lp) for lp in chunk.logprobs],
        finish_reason=chunk.finish_reason or "",
    )


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
