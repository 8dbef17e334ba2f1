"""Sampling parameters converted once per distinct wire message (router/edge/params_cache.py)."""

from __future__ import annotations

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import common_pb2
from pdserve.proto.params import params_message, params_to_proto
from pdserve.router.edge.params_cache import ParamsCache


def test_the_same_bytes_give_the_same_checked_object() -> None:
    cache = ParamsCache()
    first = cache.from_wire(common_pb2.SamplingParams(temperature=0.5, stop=["x"]), 16)
    again = cache.from_wire(common_pb2.SamplingParams(temperature=0.5, stop=["x"]), 16)
    assert again is first
    assert first == SamplingParams(max_tokens=16, temperature=0.5, stop=("x",))
    # The default max_tokens is part of the key: it depends on the prompt's length.
    shorter = cache.from_wire(common_pb2.SamplingParams(temperature=0.5, stop=["x"]), 3)
    assert shorter.max_tokens == 3 and len(cache) == 2


def test_values_are_as_the_workers_see_them() -> None:
    # 0.1 is not a float32: the workers get 0.10000000149011612, and so does the router.
    params = ParamsCache().from_wire(common_pb2.SamplingParams(top_p=0.1), 16)
    assert params.top_p == pytest.approx(0.1, abs=1e-8) and params.top_p != 0.1


def test_bad_messages_raise_every_time_and_are_not_kept() -> None:
    cache = ParamsCache()
    for _ in range(2):
        with pytest.raises(ValueError, match="temperature must be finite"):
            cache.from_wire(common_pb2.SamplingParams(temperature=float("inf")), 16)
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            cache.from_wire(common_pb2.SamplingParams(top_p=0.0), 16)
    assert len(cache) == 0


def test_the_oldest_entry_goes_first_at_capacity() -> None:
    cache = ParamsCache(capacity=2)
    a = cache.from_wire(common_pb2.SamplingParams(max_tokens=1), 16)
    b = cache.from_wire(common_pb2.SamplingParams(max_tokens=2), 16)
    cache.from_wire(common_pb2.SamplingParams(max_tokens=3), 16)  # evicts max_tokens=1
    assert len(cache) == 2
    assert cache.from_wire(common_pb2.SamplingParams(max_tokens=2), 16) is b
    assert cache.from_wire(common_pb2.SamplingParams(max_tokens=1), 16) is not a
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        ParamsCache(capacity=0)


def test_the_worker_message_is_converted_once_per_params() -> None:
    params = SamplingParams(max_tokens=5, seed=7, logprobs=2)
    assert params_message(params) is params_message(params)
    assert params_message(params) == params_to_proto(params)
