"""Builds what one engine instance owns: weights, tokenizer, the fixed KV pool, the runner."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager, make_extra_keys, num_blocks_for_budget
from engine.model.config import ModelConfig
from engine.model.loader import load_model
from engine.model.registry import ModelSource, resolve_model
from engine.runner import ModelRunner, allocate_kv_cache, bytes_per_block
from engine.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class WorkerState:
    source: ModelSource
    model_config: ModelConfig
    tokenizer: Tokenizer
    kv: KVCacheManager
    runner: ModelRunner
    max_model_len: int


def build_worker_state(config: EngineConfig) -> WorkerState:
    """Load the model and allocate its KV pool once; the pool never grows afterwards."""
    started = time.perf_counter()
    source = resolve_model(config.model)
    dtype = TORCH_DTYPES[config.dtype]
    model = load_model(source, dtype=dtype)
    model_config = model.config
    tokenizer = load_tokenizer(source)
    block_size = config.cache.block_size
    block_bytes = bytes_per_block(model_config, block_size, dtype)
    num_blocks = config.cache.num_blocks or num_blocks_for_budget(
        config.cache.memory_budget_bytes, block_bytes
    )
    kv_cache = allocate_kv_cache(model_config, num_blocks, block_size, dtype)
    kv = KVCacheManager(
        num_blocks,
        block_size,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        extra_keys=make_extra_keys(source.model_id),
    )
    runner = ModelRunner(model_config, model, kv_cache, block_size)
    max_model_len = min(model_config.max_context_tokens, config.max_model_len or 1 << 62)
    log.info(
        "loaded %s (%s, %d layers) in %.1fs; KV pool %d blocks x %d tokens = %.2f GiB",
        source.model_id,
        config.dtype,
        model_config.num_layers,
        time.perf_counter() - started,
        num_blocks,
        block_size,
        num_blocks * block_bytes / 2**30,
    )
    return WorkerState(source, model_config, tokenizer, kv, runner, max_model_len)
