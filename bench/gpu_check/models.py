"""The checked model shapes, built with seeded random weights for transformers and for the
engine (the same tensors, loaded from memory), and the engine configurations."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.engine import LLM
from pdserve.engine.model.loader import model_from_hf_state_dict
from pdserve.engine.model.registry import ModelSource
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.worker_state import TORCH_DTYPES, LoadedModel

MAX_MODEL_LEN = 4096  # the longest sequence any check runs (2,048 + 512 in the workload)


@dataclass(slots=True, frozen=True)
class Shape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    rope_theta: float

    def hf_config(self) -> Any:
        from transformers import LlamaConfig

        settings: dict[str, Any] = {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "vocab_size": self.vocab_size,
            # transformers 4 takes it as is, 5 moves it into rope_parameters
            "rope_theta": self.rope_theta,
            "max_position_embeddings": MAX_MODEL_LEN,
            "tie_word_embeddings": True,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": 0,
        }
        return LlamaConfig(**settings)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


SMOLLM2_135M = Shape("smollm2-135m", 576, 1536, 30, 9, 3, 49152, 100000.0)
LLAMA_1B = Shape("llama-1b", 2048, 8192, 16, 32, 8, 128256, 500000.0)  # Llama 3.2 1B's
TINY_SMOLLM2 = Shape("tiny-smollm2", 64, 160, 2, 4, 2, 512, 100000.0)
TINY_1B = Shape("tiny-1b", 64, 192, 3, 4, 1, 640, 500000.0)


class NumberTokenizer:
    """Random weights have no vocabulary: token ``i`` reads ``<i>`` (what the engine's
    detokenizer needs of a Hugging Face tokenizer, and nothing more)."""

    eos_token_id = None
    bos_token_id = None
    chat_template = None

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size

    def __len__(self) -> int:
        return self._vocab_size

    def decode(self, token_ids: Sequence[int], **_options: object) -> str:
        return "".join(f"<{t}>" for t in token_ids)


@dataclass(slots=True)
class ModelPair:
    """transformers' model and the engine's weights: the same values, on one device."""

    shape: Shape
    dtype: str
    hf: Any  # LlamaForCausalLM
    loaded: LoadedModel


def build_pair(shape: Shape, device: torch.device, seed: int) -> ModelPair:
    """fp32 weights drawn by transformers' own initialisation, seeded."""
    from transformers import LlamaForCausalLM

    config = shape.hf_config()
    torch.manual_seed(seed)
    with torch.device(device):
        hf = LlamaForCausalLM(config).eval()
    return ModelPair(shape, "float32", hf, _engine_weights(shape, hf, "float32"))


def in_dtype(pair: ModelPair, dtype: str) -> ModelPair:
    """The same model rounded to ``dtype`` (a copy on both sides)."""
    if dtype == pair.dtype:
        return pair
    hf = copy.deepcopy(pair.hf).to(TORCH_DTYPES[dtype])
    return ModelPair(pair.shape, dtype, hf, _engine_weights(pair.shape, hf, dtype))


def _engine_weights(shape: Shape, hf: Any, dtype: str) -> LoadedModel:
    model_id = f"random-{shape.name}"
    model = model_from_hf_state_dict(
        hf.config.to_dict(), hf.state_dict(), model_id, TORCH_DTYPES[dtype]
    )
    source = ModelSource("hf", Path("."), model_id)  # never read: the weights are in memory
    return LoadedModel(source, model, Tokenizer(NumberTokenizer(shape.vocab_size)), dtype)


@dataclass(slots=True, frozen=True)
class EngineTarget:
    """Where and how every engine of a run runs."""

    device: torch.device
    attention_backend: str
    block_size: int


def engine(pair: ModelPair, target: EngineTarget, **options: Any) -> LLM:
    """An engine on ``pair``'s weights; ``options`` as ``LLM`` takes them."""
    settings: dict[str, Any] = {
        "dtype": pair.dtype,
        "device": str(target.device),
        "attention_backend": target.attention_backend,
        "block_size": target.block_size,
        "max_model_len": MAX_MODEL_LEN,
        **options,
    }
    return LLM(loaded=pair.loaded, **settings)
