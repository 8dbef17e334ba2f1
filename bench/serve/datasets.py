"""The named benchmark datasets, each a seeded, deterministic list of work items.

| name            | item                 | lengths (tokens)                                        |
|-----------------|----------------------|---------------------------------------------------------|
| `sharegpt-like` | one completion       | log-normal prompt and output, clipped (a heavy tail)    |
| `random`        | one completion       | uniform in [L*(1-r), L*(1+r)] for input and output      |
| `shared-prefix` | one completion       | G groups; prompt = group's P-token prefix + Q question  |
| `multi-turn`    | a conversation       | T user turns; each resends the whole history (chat API) |

The same spec, count, seed and text source give the same items. Except for `shared-prefix`
(whose group order is shuffled as a whole), draws are made item by item, so the first N items
of a larger dataset are the N-item dataset.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pdserve.bench.serve.text import Prompt, TextSource

DATASET_NAMES = ("sharegpt-like", "random", "shared-prefix", "multi-turn")
SHAREGPT_MAX_DRAWS = 10_000


@dataclass(slots=True, frozen=True)
class BenchRequest:
    """One request: its prompt (a user message inside a conversation), the output length to
    ask for, and its shared-prefix group (-1 when it has none)."""

    prompt: Prompt
    max_output_tokens: int
    group: int = -1


@dataclass(slots=True, frozen=True)
class Conversation:
    """User turns sent one after another over the chat API, each with the history so far."""

    turns: tuple[BenchRequest, ...]


Item = BenchRequest | Conversation


@dataclass(slots=True, frozen=True)
class ShareGPTLikeSpec:
    """Log-normal lengths: medians and sigmas of ln(length), clipped to [min, max]; pairs
    longer than ``max_total_tokens`` together are drawn again (vLLM drops such ShareGPT
    pairs the same way), so requests fit the model's context."""

    prompt_median_tokens: float = 128.0
    prompt_sigma: float = 1.0
    output_median_tokens: float = 192.0
    output_sigma: float = 0.8
    min_tokens: int = 4
    max_prompt_tokens: int = 1024
    max_output_tokens: int = 1024
    max_total_tokens: int = 2048
    fixed_output_tokens: int | None = None  # overrides the drawn output length

    name = "sharegpt-like"

    def __post_init__(self) -> None:
        _check_positive(min_tokens=self.min_tokens, prompt_median=self.prompt_median_tokens)
        _check_positive(output_median=self.output_median_tokens)
        if not self.min_tokens <= min(self.max_prompt_tokens, self.max_output_tokens):
            raise ValueError(
                f"min_tokens={self.min_tokens} exceeds max_prompt_tokens="
                f"{self.max_prompt_tokens} or max_output_tokens={self.max_output_tokens}"
            )
        if self.fixed_output_tokens is not None:
            _check_positive(sharegpt_output_len=self.fixed_output_tokens)
        output_floor = self.fixed_output_tokens or self.min_tokens
        if self.min_tokens + output_floor > self.max_total_tokens:
            raise ValueError(
                f"--sharegpt-max-len {self.max_total_tokens} leaves no room for a "
                f"{self.min_tokens}-token prompt and a {output_floor}-token output"
            )


@dataclass(slots=True, frozen=True)
class RandomSpec:
    """Fixed lengths with a spread: uniform in [L*(1-range_ratio), L*(1+range_ratio)]."""

    input_tokens: int = 256
    output_tokens: int = 128
    range_ratio: float = 0.0

    name = "random"

    def __post_init__(self) -> None:
        _check_positive(random_input_len=self.input_tokens, random_output_len=self.output_tokens)
        _check_ratio(self.range_ratio)


@dataclass(slots=True, frozen=True)
class SharedPrefixSpec:
    """``num_groups`` groups, each with its own ``prefix_tokens`` prefix; requests are spread
    evenly over the groups (in a shuffled order) with a fresh ``question_tokens`` question."""

    num_groups: int = 4
    prefix_tokens: int = 512
    question_tokens: int = 64
    output_tokens: int = 64

    name = "shared-prefix"

    def __post_init__(self) -> None:
        _check_positive(prefix_groups=self.num_groups, prefix_len=self.prefix_tokens)
        _check_positive(question_len=self.question_tokens, prefix_output_len=self.output_tokens)


@dataclass(slots=True, frozen=True)
class MultiTurnSpec:
    """Conversations of ``num_turns`` user turns; per-turn lengths as in :class:`RandomSpec`."""

    num_turns: int = 3
    turn_input_tokens: int = 64
    turn_output_tokens: int = 64
    range_ratio: float = 0.0

    name = "multi-turn"

    def __post_init__(self) -> None:
        _check_positive(turns=self.num_turns, turn_input_len=self.turn_input_tokens)
        _check_positive(turn_output_len=self.turn_output_tokens)
        _check_ratio(self.range_ratio)


DatasetSpec = ShareGPTLikeSpec | RandomSpec | SharedPrefixSpec | MultiTurnSpec


def build_dataset(spec: DatasetSpec, num_items: int, seed: int, source: TextSource) -> list[Item]:
    """``num_items`` items of ``spec`` (conversations for multi-turn, requests otherwise)."""
    if num_items < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_items}")
    rng = random.Random(seed)
    if isinstance(spec, ShareGPTLikeSpec):
        return [_sharegpt_request(spec, rng, source) for _ in range(num_items)]
    if isinstance(spec, RandomSpec):
        return [_random_request(spec, rng, source) for _ in range(num_items)]
    if isinstance(spec, SharedPrefixSpec):
        return list(_shared_prefix_requests(spec, num_items, rng, source))
    return [_conversation(spec, rng, source) for _ in range(num_items)]


def count_requests(items: list[Item]) -> int:
    """Requests the items will send (a conversation sends one per turn)."""
    return sum(len(i.turns) if isinstance(i, Conversation) else 1 for i in items)


def spread_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds of a length drawn with ``range_ratio`` spread (at least 1)."""
    spread = round(length * range_ratio, 9)  # so 100 * 1.1 is 110, not 110.00000000000001
    low = max(1, math.floor(length - spread))
    return low, max(low, math.ceil(length + spread))


def _sharegpt_request(spec: ShareGPTLikeSpec, rng: random.Random, src: TextSource) -> Item:
    for _ in range(SHAREGPT_MAX_DRAWS):
        prompt_len = _lognormal(rng, spec.prompt_median_tokens, spec.prompt_sigma)
        output_len = _lognormal(rng, spec.output_median_tokens, spec.output_sigma)
        prompt_len = min(max(prompt_len, spec.min_tokens), spec.max_prompt_tokens)
        output_len = min(max(output_len, spec.min_tokens), spec.max_output_tokens)
        output_len = spec.fixed_output_tokens or output_len
        if prompt_len + output_len <= spec.max_total_tokens:
            return BenchRequest(src.take(rng, prompt_len), output_len)
    raise ValueError(
        f"{SHAREGPT_MAX_DRAWS} draws all exceeded --sharegpt-max-len {spec.max_total_tokens}; "
        "raise it or lower the length medians"
    )


def _random_request(spec: RandomSpec, rng: random.Random, src: TextSource) -> Item:
    prompt_len = rng.randint(*spread_range(spec.input_tokens, spec.range_ratio))
    output_len = rng.randint(*spread_range(spec.output_tokens, spec.range_ratio))
    return BenchRequest(src.take(rng, prompt_len), output_len)


def _shared_prefix_requests(
    spec: SharedPrefixSpec, num_items: int, rng: random.Random, src: TextSource
) -> list[BenchRequest]:
    prefixes = [src.take(rng, spec.prefix_tokens) for _ in range(spec.num_groups)]
    groups = [i % spec.num_groups for i in range(num_items)]
    rng.shuffle(groups)  # interleave groups so a group's requests do not arrive back to back
    return [
        BenchRequest(prefixes[g] + src.take(rng, spec.question_tokens), spec.output_tokens, g)
        for g in groups
    ]


def _conversation(spec: MultiTurnSpec, rng: random.Random, src: TextSource) -> Conversation:
    turns = []
    for _ in range(spec.num_turns):
        user_len = rng.randint(*spread_range(spec.turn_input_tokens, spec.range_ratio))
        output_len = rng.randint(*spread_range(spec.turn_output_tokens, spec.range_ratio))
        turns.append(BenchRequest(src.take(rng, user_len), output_len))
    return Conversation(tuple(turns))


def _lognormal(rng: random.Random, median: float, sigma: float) -> int:
    return round(rng.lognormvariate(math.log(median), sigma))


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _check_ratio(range_ratio: float) -> None:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
