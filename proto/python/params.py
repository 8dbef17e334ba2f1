"""Sampling parameters between protobuf and the engine's ``SamplingParams``: the one place.

The router converts a client's message once where it enters (and validates it there); the
workers convert the router's message back. Both use these functions.
"""

from __future__ import annotations

from functools import lru_cache

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import common_pb2


def params_from_proto(
    msg: common_pb2.SamplingParams, default_max_tokens: int | None = None
) -> SamplingParams:
    """Unset optional fields take the engine defaults (``max_tokens``: ``default_max_tokens``
    when given); ValueError names a bad field."""
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
        prior_output_tokens=params.prior_output_tokens,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if not params.speculative:  # set only to opt out, so default messages stay as they were
        msg.speculative = False
    return msg


@lru_cache(maxsize=256)
def params_message(params: SamplingParams) -> common_pb2.SamplingParams:
    """``params_to_proto``, cached: requests mostly repeat a few parameter sets, and the
    router's edge shares one ``SamplingParams`` object per set (``router/edge/params_cache.py``).

    The returned message is shared: callers copy it into their requests, never mutate it.
    """
    return params_to_proto(params)
