"""Weight loading: GGUF Q/K un-permutation, safetensors directories vs transformers, configs,
and resolving ``--model``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine.model.config import config_from_gguf
from pdserve.engine.model.loader import load_model, load_model_config, unpermute_qk
from pdserve.engine.model.registry import DEFAULT_MODEL_NAME, resolve_model
from pdserve.engine.model.rope import apply_rope
from pdserve.engine.runner import ModelRunner, allocate_kv_cache
from pdserve.engine.scheduler.plan import BatchPlan, ScheduledChunk


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The converter's permutation (convert_hf_to_gguf.py, LlamaModel.permute)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def interleaved_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """llama.cpp's rope: rotate pairs (2i, 2i+1). x: [T, heads, D], angles: [T, D/2]."""
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    rotated = pairs * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.view_as_real(rotated).reshape(x.shape)


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permutation(num_heads: int) -> None:
    hf_weight = torch.randn(num_heads * 8, 5)
    gguf_weight = llama_cpp_permute(hf_weight, num_heads)
    assert not torch.equal(gguf_weight, hf_weight)
    assert torch.equal(unpermute_qk(gguf_weight, num_heads), hf_weight)


def test_unpermuted_weights_with_rotate_half_rope_equal_gguf_interleaved_rope() -> None:
    """Why the un-permutation exists: same attention scores under the two rope layouts."""
    num_heads, head_dim, hidden, tokens = 3, 8, 12, 5
    hf_weight = torch.randn(num_heads * head_dim, hidden)
    gguf_weight = llama_cpp_permute(hf_weight, num_heads)
    x = torch.randn(tokens, hidden)
    angles = torch.outer(torch.arange(tokens).float(), torch.rand(head_dim // 2))
    gguf_q = interleaved_rope((x @ gguf_weight.T).view(tokens, num_heads, head_dim), angles)
    ours_q = (x @ unpermute_qk(gguf_weight, num_heads).T).view(tokens, num_heads, head_dim)
    ours_q = apply_rope(ours_q, angles.cos()[:, None], angles.sin()[:, None])
    # Per head, our dims are GGUF's dims reordered: compare through the same reordering.
    torch.testing.assert_close(
        ours_q.reshape(tokens, -1), unpermute_qk(gguf_q.reshape(tokens, -1).T, num_heads).T
    )


SYNTHETIC: dict[str, dict[str, Any]] = {
    "llama_untied": dict(model_type="llama", tie_word_embeddings=False),
    "llama_tied_llama3_rope": dict(
        model_type="llama",
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    ),
    "llama_linear_rope_biases": dict(
        model_type="llama",
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
    "qwen2_qkv_bias": dict(model_type="qwen2", tie_word_embeddings=False),
}


def save_synthetic(directory: Path, model_type: str, **overrides: Any) -> Any:
    """A tiny random model saved by transformers itself (config.json + safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **overrides,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for param in model.parameters():  # biases and norms default to 0/1: make them matter
        param.data.normal_(0.0, 0.2)
    model.save_pretrained(str(directory))
    return model


def paged_logits(model: Any, ids: list[int], block_size: int = 4) -> torch.Tensor:
    """Last-position logits after prefilling ``ids`` in two chunks through the paged pool."""
    config = model.config
    dtype = model.embed_tokens.weight.dtype
    cache = allocate_kv_cache(config, 32, block_size, dtype)
    runner = ModelRunner(config, model, cache, block_size)
    table, split = tuple(range(31, 0, -2)), len(ids) // 2 + 1
    runner.execute(BatchPlan((ScheduledChunk("s", tuple(ids[:split]), 0, table, False),)))
    last = ScheduledChunk("s", tuple(ids[split:]), split, table, True)
    return runner.execute(BatchPlan((last,)))[0]


@pytest.mark.parametrize("variant", sorted(SYNTHETIC))
def test_safetensors_directory_matches_transformers(tmp_path: Path, variant: str) -> None:
    reference = save_synthetic(tmp_path, **SYNTHETIC[variant])
    model = load_model(resolve_model(str(tmp_path)), show_progress=False)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(paged_logits(model, ids), expected, atol=1e-4, rtol=1e-4)


def test_bf16_weights_load_as_bf16(tmp_path: Path) -> None:
    reference = save_synthetic(tmp_path, "llama")
    model = load_model(resolve_model(str(tmp_path)), dtype=torch.bfloat16, show_progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = list(range(1, 30))
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0, -1]
    logits = paged_logits(model, ids)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=0.15, rtol=0.05)


def test_config_json_fields(tmp_path: Path) -> None:
    save_synthetic(tmp_path, **SYNTHETIC["qwen2_qkv_bias"])
    config = load_model_config(resolve_model(str(tmp_path)))
    assert (config.architecture, config.num_heads, config.num_kv_heads) == ("qwen2", 6, 2)
    assert (config.head_dim, config.qkv_bias, config.o_bias) == (8, True, False)


def gguf_fields(**overrides: Any) -> dict[str, Any]:
    fields = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.context_length": 256,
        "llama.vocab_size": 100,
        "tokenizer.ggml.eos_token_id": 2,
    }
    fields.update(overrides)
    return fields


def test_gguf_config_detects_tied_head_and_bias() -> None:
    tied = config_from_gguf(gguf_fields().get, {"token_embd.weight"}, "m")
    assert tied.tie_word_embeddings and not tied.qkv_bias and tied.head_dim == 16
    untied = config_from_gguf(gguf_fields().get, {"output.weight", "blk.0.attn_q.bias"}, "m")
    assert not untied.tie_word_embeddings and untied.qkv_bias
    assert untied.eos_token_ids == (2,) and untied.rope_theta == 10000.0


def test_gguf_config_missing_field_names_it() -> None:
    fields = gguf_fields()
    del fields["llama.block_count"]
    with pytest.raises(ValueError, match=r"llama\.block_count"):
        config_from_gguf(fields.get, set(), "m")


def test_default_model_resolves_to_the_packaged_gguf() -> None:
    source = resolve_model(None)
    assert source.kind == "gguf" and source.path.is_file() and source.path.suffix == ".gguf"
    assert source.model_id == DEFAULT_MODEL_NAME
    assert resolve_model(str(source.path)).path == source.path


def test_unknown_model_lists_names_and_path_forms(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=DEFAULT_MODEL_NAME) as err:
        resolve_model("no-such-model")
    assert ".gguf" in str(err.value) and "config.json" in str(err.value)
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model(str(tmp_path))  # an empty directory
