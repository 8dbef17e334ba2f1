"""Load weights from a GGUF file or a safetensors directory into our module naming.

Both sources are first read under Hugging Face parameter names (``model.layers.0.self_attn.
q_proj.weight`` ...), then fused into the layout of :mod:`pdserve.engine.model.llama` (q|k|v and
gate|up concatenated). GGUF tensors are dequantized to fp32 with ``gguf.quants.dequantize``;
for Llama-architecture GGUFs the Q/K rows are un-permuted (llama.cpp reorders them for its
interleaved rope, see :func:`unpermute_qk`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pdserve.engine.model import weight_cache
from pdserve.engine.model.config import ModelConfig, config_from_gguf, config_from_hf
from pdserve.engine.model.llama import LlamaModel
from pdserve.engine.model.registry import ModelSource

# A getter returns the fp32/native tensor stored under a Hugging Face name, or None.
TensorGetter = Callable[[str], torch.Tensor | None]

_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "rope_freq_factors": "rope_freqs.weight",
}
# llama.cpp permutes Q/K for these architectures only (Qwen2 uses the NeoX rope layout as is).
_GGUF_PERMUTED_ARCHS = ("llama", "mistral")


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (``weight: [num_heads * head_dim, ...]``).

    llama.cpp's converter regroups each head's rows from "first half | second half" into
    interleaved pairs: HF row ``j * head_dim/2 + i`` (half ``j``, index ``i``) goes to GGUF row
    ``2 * i + j``. Viewing GGUF rows as ``[heads, head_dim/2, 2]`` and swapping the last two
    axes restores the HF order.
    """
    rest = weight.shape[1:]
    head_dim = weight.shape[0] // num_heads
    assert head_dim * num_heads == weight.shape[0], (
        f"{weight.shape[0]} rows do not split into {num_heads} heads"
    )
    grouped = weight.reshape(num_heads, head_dim // 2, 2, *rest)
    return grouped.transpose(1, 2).reshape(weight.shape)


def load_model_config(source: ModelSource) -> ModelConfig:
    """Read only the metadata (GGUF header or ``config.json``)."""
    if source.kind == "gguf":
        reader = _gguf_reader(source.path)
        return config_from_gguf(
            _gguf_field_reader(reader), {t.name for t in reader.tensors}, source.model_id
        )
    raw = json.loads((source.path / "config.json").read_text())
    return config_from_hf(raw, source.model_id)


def load_state_dict(
    source: ModelSource,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    show_progress: bool = True,
) -> dict[str, torch.Tensor]:
    """All weights in our naming (see :mod:`pdserve.engine.model.llama`), cast to ``dtype``."""
    if source.kind == "gguf":
        getter = _gguf_getter(source.path, config)
    else:
        getter = _safetensors_getter(source.path)
    steps = tqdm(
        range(config.num_layers + 1),
        desc=f"loading {source.model_id}",
        unit="layer",
        disable=not show_progress,
    )
    state: dict[str, torch.Tensor] = {}
    for step in steps:
        if step < config.num_layers:
            state.update(_layer_weights(getter, config, step))
        else:
            state.update(_global_weights(getter, config))
    return {name: t.to(dtype).contiguous() for name, t in state.items()}


def load_model(
    source: ModelSource,
    dtype: torch.dtype = torch.float32,
    show_progress: bool = True,
    use_cache: bool = True,
) -> LlamaModel:
    """Config + weights -> a ready :class:`LlamaModel` in eval mode.

    A GGUF file is parsed and dequantized once; later loads read :mod:`weight_cache`.
    """
    entry = weight_cache.entry_for(source.path, dtype) if source.kind == "gguf" else None
    cached = weight_cache.read(entry) if entry is not None and use_cache else None
    if cached is not None:
        return LlamaModel.from_state_dict(*cached)
    config = load_model_config(source)
    state = load_state_dict(source, config, dtype, show_progress)
    if entry is not None and use_cache:
        weight_cache.write(entry, config, state)
    return LlamaModel.from_state_dict(config, state)


def model_from_hf_state_dict(
    raw_config: Mapping[str, Any],
    hf_state: Mapping[str, torch.Tensor],
    model_id: str,
    dtype: torch.dtype = torch.float32,
) -> LlamaModel:
    """A model from weights already in memory under Hugging Face names (``config.json``'s
    dict and e.g. ``LlamaForCausalLM.state_dict()``), copied and cast to ``dtype``: for
    checks that build a model with random weights and no files."""
    config = config_from_hf(raw_config, model_id)
    get = hf_state.get
    state = {}
    for i in range(config.num_layers):
        state.update(_layer_weights(get, config, i))
    state.update(_global_weights(get, config))
    return LlamaModel.from_state_dict(
        config, {name: t.detach().to(dtype).clone() for name, t in state.items()}
    )


def _layer_weights(get: TensorGetter, config: ModelConfig, i: int) -> dict[str, torch.Tensor]:
    def hf(name: str) -> torch.Tensor:
        return _need(get, f"model.layers.{i}.{name}")

    def cat(names: tuple[str, ...]) -> torch.Tensor:
        return torch.cat([hf(name) for name in names])

    ours = f"layers.{i}."
    out = {
        ours + "input_norm.weight": hf("input_layernorm.weight"),
        ours + "post_attn_norm.weight": hf("post_attention_layernorm.weight"),
        ours + "attn.qkv_proj.weight": cat(_projections("self_attn", ("q", "k", "v"), "weight")),
        ours + "attn.o_proj.weight": hf("self_attn.o_proj.weight"),
        ours + "mlp.gate_up_proj.weight": cat(_projections("mlp", ("gate", "up"), "weight")),
        ours + "mlp.down_proj.weight": hf("mlp.down_proj.weight"),
    }
    if config.qkv_bias:
        out[ours + "attn.qkv_proj.bias"] = cat(_projections("self_attn", ("q", "k", "v"), "bias"))
    if config.o_bias:
        out[ours + "attn.o_proj.bias"] = hf("self_attn.o_proj.bias")
    if config.mlp_bias:
        out[ours + "mlp.gate_up_proj.bias"] = cat(_projections("mlp", ("gate", "up"), "bias"))
        out[ours + "mlp.down_proj.bias"] = hf("mlp.down_proj.bias")
    return out


def _projections(module: str, parts: tuple[str, ...], kind: str) -> tuple[str, ...]:
    return tuple(f"{module}.{part}_proj.{kind}" for part in parts)


def _global_weights(get: TensorGetter, config: ModelConfig) -> dict[str, torch.Tensor]:
    out = {
        "embed_tokens.weight": _need(get, "model.embed_tokens.weight"),
        "norm.weight": _need(get, "model.norm.weight"),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = _need(get, "lm_head.weight")
    freq_factors = get("rope_freq_factors")
    if freq_factors is not None:
        out["rope_freq_factors"] = freq_factors
    return out


def _need(get: TensorGetter, name: str) -> torch.Tensor:
    tensor = get(name)
    if tensor is None:
        raise ValueError(f"weight {name!r} is missing from the model files")
    return tensor


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: Path) -> Any:
    # Parsing the header (tens of thousands of vocab strings) takes seconds: config and
    # weights share one reader. The reader memory-maps the file, so keeping it is cheap.
    import gguf

    return gguf.GGUFReader(str(path))


def _gguf_field_reader(reader: Any) -> Callable[[str], Any]:
    def read(key: str) -> Any:
        field = reader.get_field(key)
        return None if field is None else field.contents()

    return read


def _gguf_getter(path: Path, config: ModelConfig) -> TensorGetter:
    from gguf.quants import dequantize

    tensors = {t.name: t for t in _gguf_reader(path).tensors}
    permuted = config.architecture in _GGUF_PERMUTED_ARCHS

    def get(hf_name: str) -> torch.Tensor | None:
        gguf_name = _gguf_name(hf_name)
        tensor = tensors.get(gguf_name)
        if tensor is None:
            return None
        # dequantize returns rows in numpy order: [out_features, in_features] for matrices.
        weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
        if permuted and ".attn_q." in gguf_name:
            weight = unpermute_qk(weight, config.num_heads)
        elif permuted and ".attn_k." in gguf_name:
            weight = unpermute_qk(weight, config.num_kv_heads)
        return weight

    return get


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    _, _, index, rest = hf_name.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{index}.{_GGUF_LAYER_NAMES[rest]}"


def _safetensors_getter(directory: Path) -> TensorGetter:
    from safetensors import safe_open

    # Handles stay open (memory-mapped) for the getter's lifetime: one open per file.
    handle_of: dict[str, Any] = {}
    for file in sorted(directory.glob("*.safetensors")):
        handle = safe_open(str(file), framework="pt")
        handle_of.update(dict.fromkeys(handle.keys(), handle))

    def get(hf_name: str) -> torch.Tensor | None:
        handle = handle_of.get(hf_name)
        if handle is None:
            return None
        tensor: torch.Tensor = handle.get_tensor(hf_name)
        return tensor

    return get
