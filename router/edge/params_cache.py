"""Sampling parameters of the gRPC edge, converted and checked once per distinct message.

Clients send a handful of parameter sets over and over; converting one (``ListFields``,
``SamplingParams`` validation, the float32 narrowing of ``as_sent_to_workers``) costs more
than serializing it. ``SamplingParams`` is frozen, so one object can serve every request
that sent the same bytes -- which also lets ``pdserve.proto.params.params_message`` hit its
cache on identity.
"""

from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import common_pb2
from pdserve.proto.params import params_from_proto
from pdserve.router.edge.frontend import as_sent_to_workers


class ParamsCache:
    """Checked ``SamplingParams`` by (wire bytes, default max_tokens); at most ``capacity``.

    Only successful conversions are kept: a bad message raises on every request, with the
    same ValueError as without the cache.
    """

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._params: dict[tuple[bytes, int], SamplingParams] = {}

    def from_wire(self, msg: common_pb2.SamplingParams, default_max_tokens: int) -> SamplingParams:
        """``as_sent_to_workers(params_from_proto(msg, default_max_tokens))``, cached."""
        key = (msg.SerializeToString(deterministic=True), default_max_tokens)
        params = self._params.get(key)
        if params is None:
            params = as_sent_to_workers(params_from_proto(msg, default_max_tokens))
            if len(self._params) >= self.capacity:
                del self._params[next(iter(self._params))]  # the oldest entry
            self._params[key] = params
        return params

    def __len__(self) -> int:
        return len(self._params)
