"""Tokenizer, chat template and incremental detokenization for the served model.

The tokenizer and its chat template come from the same file as the weights: the GGUF
metadata (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``) or a Hugging Face
directory. transformers is imported inside :func:`load_tokenizer` only, so importing
``pdserve.engine`` stays light.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.engine.model.registry import ModelSource, resolve_model
from pdserve.engine.paths import cache_dir

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context so the first output token decodes as it would mid-text
# (some tokenizers drop a leading space at the start of a decode).
_PROMPT_CONTEXT_TOKENS = 5


class Tokenizer:
    """A thin, typed wrapper over a Hugging Face fast tokenizer."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self._hf = hf_tokenizer

    @property
    def eos_token_id(self) -> int | None:
        eos = self._hf.eos_token_id
        return None if eos is None else int(eos)

    @property
    def bos_token_id(self) -> int | None:
        bos = self._hf.bos_token_id
        return None if bos is None else int(bos)

    @property
    def vocab_size(self) -> int:
        return len(self._hf)

    @property
    def chat_template(self) -> str | None:
        template: str | None = self._hf.chat_template
        return template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens (e.g. BOS) added as the model expects."""
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text: str = self._hf.decode(
            list(token_ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        return text

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Render ``messages`` with the model's chat template and tokenize the result."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        out = self._hf.apply_chat_template(
            [dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
        )
        # transformers 5 returns a BatchEncoding, 4.x a plain list.
        ids = out["input_ids"] if isinstance(out, Mapping) else out
        return [int(t) for t in ids]

    def incremental_detokenizer(
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A detokenizer for one output stream that follows ``prompt_ids``."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    A character whose UTF-8 bytes span several tokens decodes to U+FFFD until its last byte
    arrives; such a delta is held back, so deltas never contain half characters. The ids are
    decoded in a small window: ``ids[prefix:read]`` is text already emitted (context for the
    decoder), ``ids[read:]`` is pending::

        ids:  ... | prefix ...... read | pending ...
                    (emitted, context)   (decoded together with the context)

    ``text`` is everything emitted so far, for stop-string checks.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, new_token_ids: int | Sequence[int]) -> str:
        """Append one or more tokens; returns the newly completed text (possibly ``""``)."""
        if isinstance(new_token_ids, int):
            self._ids.append(new_token_ids)
        else:
            self._ids.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At end of sequence: emit whatever is pending, even an incomplete character."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self._tokenizer.decode
        context = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        window = decode(self._ids[self._prefix_offset :], self._skip_special)
        if len(window) <= len(context) or (window.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        delta = window[len(context) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta


def load_tokenizer(model: str | ModelSource | None = None) -> Tokenizer:
    """Load the tokenizer of a ``--model`` value (name, .gguf path or HF directory)."""
    from transformers import AutoTokenizer

    source = model if isinstance(model, ModelSource) else resolve_model(model)
    if source.kind != "gguf":
        return Tokenizer(AutoTokenizer.from_pretrained(str(source.path)))
    cached = _gguf_tokenizer_cache(source.path)
    if (cached / "tokenizer_config.json").exists():
        return Tokenizer(AutoTokenizer.from_pretrained(str(cached)))
    # Building a tokenizer from GGUF metadata takes seconds; every worker process would pay
    # it at start, so the converted tokenizer is saved once and reloaded from disk after.
    hf = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    _save_atomically(hf, cached)
    return Tokenizer(hf)


def _gguf_tokenizer_cache(path: Path) -> Path:
    """Cache folder keyed by the GGUF file's path, size and mtime (a new file, a new key)."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return cache_dir() / "tokenizers" / key.hexdigest()[:16]


def _save_atomically(hf: Any, target: Path) -> None:
    """Save into a fresh folder, then rename: concurrent workers never see half a cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent))
    hf.save_pretrained(str(staging))
    try:
        staging.rename(target)
    except OSError:  # another process won the race; its copy is as good as ours
        shutil.rmtree(staging, ignore_errors=True)
