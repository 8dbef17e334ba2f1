"""The model's shape and numerics, read once from GGUF metadata or a ``config.json``.

Supported architectures: Llama (incl. Llama 3 rope scaling), Mistral and Qwen2 (q/k/v bias).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """Context-extension scaling of the rope frequencies (``linear`` or ``llama3``)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(
                f"unsupported rope scaling type {self.rope_type!r}; "
                "supported: 'linear', 'llama3' (or none)"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Everything the torch model, the KV pool and the tokenizer need to agree on."""

    model_id: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_context_tokens: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {SUPPORTED_ARCHITECTURES}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"rope needs an even head_dim, got {self.head_dim}")

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def config_from_gguf(
    read_field: Callable[[str], Any], tensor_names: Collection[str], model_id: str
) -> ModelConfig:
    """Build a config from GGUF metadata.

    ``read_field(key)`` returns a field's value or ``None`` when absent; ``tensor_names`` tells
    whether the lm head is tied (no ``output.weight``) and whether q/k/v carry a bias.
    """
    arch = str(read_field("general.architecture"))

    def need(key: str) -> Any:
        value = read_field(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF file for {model_id!r} lacks metadata {arch}.{key}")
        return value

    num_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = read_field(f"{arch}.attention.key_length") or hidden // num_heads
    vocab = read_field(f"{arch}.vocab_size") or _gguf_vocab_size(read_field, model_id)
    eos = read_field("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        model_id=model_id,
        architecture=arch,
        num_layers=int(need("block_count")),
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(read_field(f"{arch}.attention.head_count_kv") or num_heads),
        head_dim=int(head_dim),
        intermediate_size=int(need("feed_forward_length")),
        vocab_size=int(vocab),
        rope_theta=float(read_field(f"{arch}.rope.freq_base") or 10000.0),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_context_tokens=int(need("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        rope_scaling=_gguf_rope_scaling(read_field, arch),
        bos_token_id=_optional_int(read_field("tokenizer.ggml.bos_token_id")),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _gguf_vocab_size(read_field: Callable[[str], Any], model_id: str) -> int:
    tokens = read_field("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"GGUF file for {model_id!r} has neither vocab_size nor a token list")
    return len(tokens)


def _gguf_rope_scaling(read_field: Callable[[str], Any], arch: str) -> RopeScaling | None:
    # llama3-style scaling is not in the metadata: llama.cpp ships it as a rope_freqs tensor,
    # which the loader hands to the model as per-frequency divisors.
    kind = read_field(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(read_field(f"{arch}.rope.scaling.factor") or 1.0)
    if kind != "linear":
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r}; supported: 'linear'")
    return RopeScaling(rope_type="linear", factor=factor)


def config_from_hf(raw: Mapping[str, Any], model_id: str) -> ModelConfig:
    """Build a config from a Hugging Face ``config.json`` (transformers 4.x or 5.x layout)."""
    model_type = str(raw.get("model_type", ""))
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    attention_bias = bool(raw.get("attention_bias", False))
    theta, scaling = _hf_rope(raw)
    return ModelConfig(
        model_id=model_id,
        architecture=model_type,
        num_layers=int(raw["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        intermediate_size=int(raw["intermediate_size"]),
        vocab_size=int(raw["vocab_size"]),
        rope_theta=theta,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_context_tokens=_hf_max_context(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope_scaling=scaling,
        bos_token_id=_optional_int(raw.get("bos_token_id")),
        eos_token_ids=_id_tuple(raw.get("eos_token_id")),
    )


def _hf_rope(raw: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x wrote rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )
    return theta, scaling


def _hf_max_context(raw: Mapping[str, Any]) -> int:
    max_pos = int(raw.get("max_position_embeddings", 4096))
    # A sliding window shorter than the context would change attention; capping the context
    # at the window keeps full attention exact instead of silently wrong.
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", raw.get("model_type") == "mistral")
    if window and uses_window:
        return min(max_pos, int(window))
    return max_pos


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)
