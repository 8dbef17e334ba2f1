"""The Llama-family model: resolving ``--model``, its config, weight loading and the decoder.

This package root imports no torch (the router resolves models and reads configs too);
take the torch parts from their modules: ``engine.model.loader.load_model`` and
``engine.model.llama.LlamaModel``.
"""

from engine.model.config import ModelConfig, RopeScaling
from engine.model.registry import (
    DEFAULT_MODEL_NAME,
    ModelSource,
    known_model_names,
    resolve_model,
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "ModelConfig",
    "ModelSource",
    "RopeScaling",
    "known_model_names",
    "resolve_model",
]
