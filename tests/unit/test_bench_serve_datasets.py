"""Datasets of the serving benchmark: seeded, lengths in range, prefixes really shared."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest

from pdserve.bench.serve.datasets import (
    BenchRequest,
    Conversation,
    MultiTurnSpec,
    RandomSpec,
    SharedPrefixSpec,
    ShareGPTLikeSpec,
    build_dataset,
    count_requests,
    spread_range,
)
from pdserve.bench.serve.text import Prompt, TextSource, load_corpus_paragraphs
from pdserve.bench.serve.tokens import approx_tokens, words_for_tokens

PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Serving systems split prefill from decode so each phase scales on its own.",
    "A block of sixteen tokens is the unit of the paged key value cache.",
]


class ByteTokenizer:
    """A real (if simple) tokenizer: one token per UTF-8 byte."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(token_ids).decode(errors="replace")


def _requests(items: list[BenchRequest | Conversation]) -> list[BenchRequest]:
    assert all(isinstance(i, BenchRequest) for i in items)
    return [i for i in items if isinstance(i, BenchRequest)]


@pytest.fixture
def exact() -> TextSource:
    return TextSource(ByteTokenizer(), PARAGRAPHS)


@pytest.mark.parametrize(
    "spec",
    [ShareGPTLikeSpec(), RandomSpec(32, 8, 0.5), SharedPrefixSpec(3, 20, 5, 4), MultiTurnSpec()],
)
def test_same_seed_same_items_other_seed_other_items(spec: object, exact: TextSource) -> None:
    first = build_dataset(spec, 12, seed=7, source=exact)  # type: ignore[arg-type]
    again = build_dataset(spec, 12, seed=7, source=exact)  # type: ignore[arg-type]
    other = build_dataset(spec, 12, seed=8, source=exact)  # type: ignore[arg-type]
    assert first == again
    assert first != other


def test_random_lengths_stay_in_the_ratio_range_and_are_exact_token_counts(
    exact: TextSource,
) -> None:
    spec = RandomSpec(input_tokens=40, output_tokens=10, range_ratio=0.25)
    reqs = _requests(build_dataset(spec, 300, seed=1, source=exact))
    inputs = [r.prompt.num_tokens for r in reqs]
    outputs = [r.max_output_tokens for r in reqs]
    assert min(inputs) >= 30 and max(inputs) <= 50
    assert min(outputs) >= 7 and max(outputs) <= 13
    assert len(set(inputs)) > 10  # the range is really used
    for r in reqs:
        assert r.prompt.token_ids is not None
        assert len(r.prompt.token_ids) == r.prompt.num_tokens


def test_random_with_zero_ratio_is_fixed_length(exact: TextSource) -> None:
    reqs = _requests(build_dataset(RandomSpec(17, 5), 20, seed=0, source=exact))
    assert {r.prompt.num_tokens for r in reqs} == {17}
    assert {r.max_output_tokens for r in reqs} == {5}


def test_spread_range_bounds() -> None:
    assert spread_range(100, 0.1) == (90, 110)
    assert spread_range(1, 0.9) == (1, 2)
    assert spread_range(10, 0.0) == (10, 10)


def test_sharegpt_lengths_are_clipped_and_heavy_tailed(exact: TextSource) -> None:
    spec = ShareGPTLikeSpec(min_tokens=4, max_prompt_tokens=600, max_output_tokens=500)
    reqs = _requests(build_dataset(spec, 400, seed=3, source=exact))
    prompts = sorted(r.prompt.num_tokens for r in reqs)
    assert prompts[0] >= 4 and prompts[-1] <= 600
    assert all(4 <= r.max_output_tokens <= 500 for r in reqs)
    mean = sum(prompts) / len(prompts)
    median = prompts[len(prompts) // 2]
    assert mean > median  # log-normal: right-skewed


def test_sharegpt_pairs_fit_the_total_limit(exact: TextSource) -> None:
    spec = ShareGPTLikeSpec(max_total_tokens=300)
    reqs = _requests(build_dataset(spec, 300, seed=4, source=exact))
    totals = [r.prompt.num_tokens + r.max_output_tokens for r in reqs]
    assert max(totals) <= 300
    assert max(totals) > 250  # the limit bounds the draws, it does not replace them


def test_sharegpt_fixed_output_len(exact: TextSource) -> None:
    spec = ShareGPTLikeSpec(fixed_output_tokens=33)
    reqs = _requests(build_dataset(spec, 10, seed=0, source=exact))
    assert {r.max_output_tokens for r in reqs} == {33}


def test_shared_prefix_groups_share_exactly_their_prefix(exact: TextSource) -> None:
    spec = SharedPrefixSpec(num_groups=3, prefix_tokens=24, question_tokens=6, output_tokens=4)
    reqs = _requests(build_dataset(spec, 12, seed=5, source=exact))
    assert Counter(r.group for r in reqs) == {0: 4, 1: 4, 2: 4}
    prefixes: dict[int, tuple[int, ...]] = {}
    for r in reqs:
        ids = r.prompt.token_ids
        assert ids is not None and len(ids) == 30
        assert prefixes.setdefault(r.group, ids[:24]) == ids[:24]
    assert len(set(prefixes.values())) == 3  # groups differ from each other
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # interleaved


def test_shared_prefix_without_tokenizer_shares_text() -> None:
    source = TextSource(None, PARAGRAPHS)
    spec = SharedPrefixSpec(num_groups=2, prefix_tokens=40, question_tokens=8, output_tokens=4)
    reqs = _requests(build_dataset(spec, 6, seed=2, source=source))
    prefix_words = words_for_tokens(40)
    for group in (0, 1):
        texts = [r.prompt.text for r in reqs if r.group == group]
        heads = {" ".join(t.split()[:prefix_words]) for t in texts}
        assert len(heads) == 1
        assert len(set(texts)) > 1  # the questions differ


def test_words_rule_without_tokenizer() -> None:
    source = TextSource(None, PARAGRAPHS)
    prompt = source.take(random.Random(0), 100)
    assert prompt.token_ids is None and prompt.num_tokens == 100
    assert len(prompt.text.split()) == words_for_tokens(100) == 75
    assert approx_tokens(prompt.text) == 100


def test_builtin_words_when_no_corpus() -> None:
    prompt = TextSource().take(random.Random(0), 8)
    assert len(prompt.text.split()) == 6


def test_multi_turn_conversations(exact: TextSource) -> None:
    spec = MultiTurnSpec(num_turns=4, turn_input_tokens=10, turn_output_tokens=6)
    items = build_dataset(spec, 5, seed=0, source=exact)
    assert all(isinstance(i, Conversation) and len(i.turns) == 4 for i in items)
    assert count_requests(items) == 20
    turns = [t for i in items if isinstance(i, Conversation) for t in i.turns]
    assert {t.prompt.num_tokens for t in turns} == {10}
    assert {t.max_output_tokens for t in turns} == {6}


def test_prompt_concatenation_keeps_ids() -> None:
    joined = Prompt("ab", (1, 2), 2) + Prompt("c", (3,), 1)
    assert joined == Prompt("abc", (1, 2, 3), 3)
    assert (Prompt("a b", None, 3) + Prompt("c", None, 1)) == Prompt("a b c", None, 4)


@pytest.mark.parametrize(
    "make",
    [
        lambda: RandomSpec(0, 5),
        lambda: RandomSpec(5, 5, 1.0),
        lambda: SharedPrefixSpec(num_groups=0),
        lambda: MultiTurnSpec(num_turns=0),
        lambda: ShareGPTLikeSpec(min_tokens=10, max_output_tokens=5),
        lambda: ShareGPTLikeSpec(fixed_output_tokens=100, max_total_tokens=50),
    ],
)
def test_bad_specs_raise_value_error(make: object) -> None:
    with pytest.raises(ValueError):
        make()  # type: ignore[operator]


def test_bad_count_raises(exact: TextSource) -> None:
    with pytest.raises(ValueError, match="num-prompts"):
        build_dataset(RandomSpec(), 0, seed=0, source=exact)


def test_corpus_paragraphs_from_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second  file\n\n\n   \nlast\n")
    (tmp_path / "a.txt").write_text("First line\nwraps here.\n\nNext   paragraph.\n")
    (tmp_path / "ignored.md").write_text("not text")
    assert load_corpus_paragraphs(tmp_path) == [
        "First line wraps here.",
        "Next paragraph.",
        "second file",
        "last",
    ]
    assert load_corpus_paragraphs(tmp_path / "b.txt") == ["second file", "last"]
    assert load_corpus_paragraphs(tmp_path / "missing") == []
    assert len(load_corpus_paragraphs()) > 100  # the shipped bench/data corpus
