"""Per-request sampling parameters (no torch: the scheduler and the router read them too)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. ``temperature == 0`` is greedy.

    Validation happens here, once: a bad value raises ``ValueError`` naming the field and the
    allowed range, which the edges map to INVALID_ARGUMENT / HTTP 400.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each token
    n: int = 1
    speculative: bool = True  # False: never speculate for this request (output is the same)
    # The last N prompt tokens are output an earlier attempt of this request generated (the
    # router's failover replays them as prompt): seeded draws and presence/frequency
    # penalties count them as output, so the continuation is the uninterrupted run's.
    prior_output_tokens: int = 0

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(
            math.isfinite(self.temperature), f"temperature must be finite, got {self.temperature}"
        )
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        _check(
            math.isfinite(self.repetition_penalty),
            f"repetition_penalty must be finite, got {self.repetition_penalty}",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            f"logprobs must be in [0, 20], got {self.logprobs}",
        )
        _check(1 <= self.n <= 16, f"n must be in [1, 16], got {self.n}")
        _check(
            self.prior_output_tokens >= 0,
            f"prior_output_tokens must be >= 0, got {self.prior_output_tokens}",
        )
        _check(all(s for s in self.stop), "stop strings must be non-empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0")

    @classmethod
    def from_fields(
        cls, values: Mapping[str, object], default_max_tokens: int | None = None
    ) -> SamplingParams:
        """Build from the fields a caller set; every other field keeps its default.

        The edges pass a wire message's set fields by name (for protobuf:
        ``{f.name: v for f, v in msg.ListFields()}``), so "unset" means "engine default"
        the same way for every caller. ``default_max_tokens`` replaces the class default of
        ``max_tokens`` when the caller set none (the router's configured default). Sequence
        fields may be any iterable. ValueError names an unknown field or a bad value.
        """
        unknown = sorted(set(values) - _FIELD_NAMES)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {unknown}; known: {sorted(_FIELD_NAMES)}"
            )
        kwargs: dict[str, Any] = dict(values)
        if default_max_tokens is not None:
            kwargs.setdefault("max_tokens", default_max_tokens)
        for name in _TUPLE_FIELDS & kwargs.keys():
            kwargs[name] = tuple(_iterable(kwargs[name], name))
        return cls(**kwargs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))
_TUPLE_FIELDS = frozenset({"stop", "stop_token_ids"})


def _iterable(value: object, name: str) -> Iterable[object]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a sequence, got {type(value).__name__} {value!r:.80}")
    return value


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
