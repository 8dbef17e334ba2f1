"""The disk caches of converted tokenizers and dequantized GGUF weights change nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine.model import weight_cache
from pdserve.engine.model.loader import load_model
from pdserve.engine.tokenizer import load_tokenizer


@pytest.fixture()
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_cached_weights_equal_the_gguf_dequantization(
    fresh_cache: Path, default_model_source: Any
) -> None:
    direct = load_model(default_model_source, show_progress=False, use_cache=False)
    entry = weight_cache.entry_for(default_model_source.path, torch.float32)
    assert weight_cache.read(entry) is None
    load_model(default_model_source, show_progress=False)  # writes the entry
    cached = weight_cache.read(entry)
    assert cached is not None
    config, state = cached
    assert config == direct.config
    for name, tensor in direct.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_cached_tokenizer_encodes_and_templates_like_the_gguf_one(
    fresh_cache: Path, default_model_source: Any, hf_smollm2_tokenizer: Any
) -> None:
    first = load_tokenizer(default_model_source)  # converts and writes the cache
    assert any(fresh_cache.joinpath("tokenizers").iterdir())
    second = load_tokenizer(default_model_source)  # reads the cache
    text = "Héllo wörld 🙂 — 東京 <|im_start|>"
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    expected = hf_smollm2_tokenizer(text).input_ids
    assert first.encode(text) == second.encode(text) == expected
    assert first.apply_chat_template(chat) == second.apply_chat_template(chat)
    assert second.eos_token_id == first.eos_token_id
