"""Prompt text of a requested token length, cut from a corpus at seeded random offsets.

The corpus is the English text under ``bench/data`` (see its SOURCES.md) or, when that holds
no ``*.txt`` files, the built-in word list. With a tokenizer the corpus is tokenized once and
prompts are exact token slices (sent as ids); without one they are word slices sized by the
words->tokens rule of :mod:`pdserve.bench.serve.tokens` (sent as text).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pdserve.bench.serve.tokens import TokenizerLike, approx_tokens, words_for_tokens
from pdserve.bench.serve.words import WORDS

T = TypeVar("T")
DATA_DIR = Path(__file__).resolve().parents[1] / "data"


@dataclass(slots=True, frozen=True)
class Prompt:
    """Prompt text, its exact token ids when a tokenizer made them, and its length in tokens
    (exact with ids, approximate without)."""

    text: str
    token_ids: tuple[int, ...] | None
    num_tokens: int

    def __add__(self, other: Prompt) -> Prompt:
        if self.token_ids is not None and other.token_ids is not None:
            ids = self.token_ids + other.token_ids
            return Prompt(self.text + other.text, ids, len(ids))
        return Prompt(f"{self.text} {other.text}", None, self.num_tokens + other.num_tokens)


def load_corpus_paragraphs(path: Path | None = None) -> list[str]:
    """Paragraphs (whitespace collapsed) of a text file, or of every ``*.txt`` in a
    directory in name order (default ``bench/data``); [] when there is no text."""
    path = path or DATA_DIR
    files = [path] if path.is_file() else sorted(path.glob("*.txt"))
    paragraphs = []
    for file in files:
        for block in re.split(r"\n\s*\n", file.read_text(encoding="utf-8")):
            if text := " ".join(block.split()):
                paragraphs.append(text)
    return paragraphs


class TextSource:
    """Hands out prompts of a given token length from a fixed corpus."""

    def __init__(
        self, tokenizer: TokenizerLike | None = None, paragraphs: Sequence[str] = ()
    ) -> None:
        text = " ".join(paragraphs) if paragraphs else " ".join(WORDS)
        self._tokenizer = tokenizer
        self._words = text.split()
        self._ids = tokenizer.encode(text) if tokenizer is not None else []
        if tokenizer is not None and not self._ids:
            raise ValueError("the tokenizer turned the prompt corpus into no tokens")

    @property
    def exact(self) -> bool:
        """True when prompt lengths are exact token counts (a tokenizer is in use)."""
        return self._tokenizer is not None

    def take(self, rng: random.Random, num_tokens: int) -> Prompt:
        """A prompt of ``num_tokens`` tokens starting at a random corpus offset (wrapping)."""
        if num_tokens < 1:
            raise ValueError(f"a prompt needs at least 1 token, got {num_tokens}")
        if self._tokenizer is None:
            num_words = words_for_tokens(num_tokens)
            words = _cyclic_slice(self._words, rng.randrange(len(self._words)), num_words)
            return Prompt(" ".join(words), None, num_tokens)
        ids = tuple(_cyclic_slice(self._ids, rng.randrange(len(self._ids)), num_tokens))
        return Prompt(self._tokenizer.decode(ids), ids, num_tokens)

    def measure(self, text: str) -> int:
        """Token length of ``text``: exact with a tokenizer, else the words rule."""
        if self._tokenizer is None:
            return approx_tokens(text)
        return len(self._tokenizer.encode(text))


def _cyclic_slice(items: Sequence[T], start: int, length: int) -> list[T]:
    return [items[(start + i) % len(items)] for i in range(length)]
