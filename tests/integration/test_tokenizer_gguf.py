"""The tokenizer read from the GGUF: round trip, chat template, incremental detokenization."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import pytest

pytestmark = pytest.mark.slow

TEXTS = (
    "Hello, world!",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Emoji: 😀🚀 flags 🇫🇷🇯🇵 family 👨‍👩‍👧 done.",
    "中文文本，日本語のテキスト、한국어 텍스트.",
    "Ünïcödé façade — “quotes” … ✨",
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi 👋 in 中文."},
]


def gguf_chat_template(path: Path) -> str:
    """The template string straight from the GGUF metadata (not through transformers)."""
    import gguf

    field = gguf.GGUFReader(str(path)).get_field("tokenizer.chat_template")
    assert field is not None, "the default model ships a chat template"
    return str(field.contents())


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(smollm2_tokenizer: Any, text: str) -> None:
    ids = smollm2_tokenizer.encode(text)
    assert ids and all(0 <= t < smollm2_tokenizer.vocab_size for t in ids)
    assert smollm2_tokenizer.decode(ids) == text


def test_chat_template_equals_transformers_and_the_gguf_template(
    smollm2_tokenizer: Any, hf_smollm2_tokenizer: Any, default_model_path: Path
) -> None:
    ours = smollm2_tokenizer.apply_chat_template(CHAT)
    reference = hf_smollm2_tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True
    )
    assert ours == list(reference["input_ids"])
    rendered = jinja2.Template(gguf_chat_template(default_model_path)).render(
        messages=CHAT, add_generation_prompt=True
    )
    assert smollm2_tokenizer.decode(ours, skip_special_tokens=False) == rendered
    assert ours == hf_smollm2_tokenizer.encode(rendered, add_special_tokens=False)


def test_eos_is_the_chat_end_token(smollm2_tokenizer: Any) -> None:
    assert smollm2_tokenizer.eos_token_id is not None
    assert smollm2_tokenizer.decode([smollm2_tokenizer.eos_token_id], False) == "<|im_end|>"


@pytest.mark.parametrize("text", TEXTS[2:])
def test_incremental_detokenizer_equals_full_decode(smollm2_tokenizer: Any, text: str) -> None:
    ids = smollm2_tokenizer.encode(text)
    assert any("\ufffd" in smollm2_tokenizer.decode([t]) for t in ids), (
        "the text should contain characters split across tokens"
    )
    prompt = smollm2_tokenizer.encode("Answer:")
    detok = smollm2_tokenizer.incremental_detokenizer(prompt)
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == detok.text == smollm2_tokenizer.decode(ids)


def test_incremental_detokenizer_skips_special_tokens_and_flushes(
    smollm2_tokenizer: Any,
) -> None:
    emoji_ids = smollm2_tokenizer.encode("🚀")
    assert len(emoji_ids) > 1, "expected the emoji's bytes to span several tokens"
    detok = smollm2_tokenizer.incremental_detokenizer()
    assert detok.add(emoji_ids[0]) == ""  # an incomplete character is held back
    assert detok.add(emoji_ids[1:]) == "🚀"
    assert detok.add(smollm2_tokenizer.eos_token_id) == ""
    cut = smollm2_tokenizer.incremental_detokenizer()
    assert cut.add(emoji_ids[0]) == ""
    assert cut.flush() == "\ufffd"  # end of stream: the broken character is all there is
