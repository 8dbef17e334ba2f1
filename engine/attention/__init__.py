"""Paged attention: per-step metadata, the backend interface and its CPU/CUDA backends."""

from pdserve.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    ChunkLike,
    StepLayout,
    layout_chunks,
    token_positions,
)
from pdserve.engine.attention.registry import backend_names, get_backend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ChunkLike",
    "StepLayout",
    "backend_names",
    "get_backend",
    "layout_chunks",
    "token_positions",
]
