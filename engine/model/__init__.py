"""The Llama-family model: resolving ``--model``, its config, weight loading and the decoder.

This package root imports no torch (the router resolves models and reads configs too);
take the torch parts from their modules: ``pdserve.engine.model.loader.load_model`` and
``pdserve.engine.model.llama.LlamaModel``.
"""

from pdserve.engine.model.config import ModelConfig, RopeScaling
from pdserve.engine.model.registry import (
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
