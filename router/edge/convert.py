"""Protobuf <-> the router's own dataclasses (chunks, logprobs), done once at the edge.

Sampling parameters convert in ``pdserve.proto.params``, which the workers use too.
"""

from __future__ import annotations

from pdserve.proto import common_pb2
from pdserve.router.request.types import ChunkEvent, TokenLogprob


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
