"""Builds what one engine instance owns: weights, tokenizer, the fixed KV pool, the runner."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdserve.engine.attention import get_backend
from pdserve.engine.attention.kv_format import resolve_kv_format
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache import KVCacheManager, make_extra_keys, num_blocks_for_budget
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.llama import LlamaModel
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.registry import ModelSource, resolve_model
from pdserve.engine.runner import ModelRunner, allocate_kv_cache, bytes_per_block
from pdserve.engine.tiers import TierStore, build_tiers
from pdserve.engine.tokenizer import Tokenizer, load_tokenizer

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
    tiers: TierStore | None  # the KV tiers under the pool, if configured


@dataclass(slots=True, frozen=True)
class LoadedModel:
    """Weights and tokenizer: loaded once, shareable by engines with different pools."""

    source: ModelSource
    model: LlamaModel
    tokenizer: Tokenizer
    dtype: str


def load(model: str, dtype: str = "float32") -> LoadedModel:
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
    source = resolve_model(model)
    weights = load_model(source, dtype=TORCH_DTYPES[dtype])
    return LoadedModel(source, weights, load_tokenizer(source), dtype)


def build_worker_state(config: EngineConfig, loaded: LoadedModel | None = None) -> WorkerState:
    """Allocate the KV pool once (it never grows afterwards) around loaded weights.

    ``loaded`` reuses weights already in memory (it must match ``config.model``/``dtype``).
    """
    started = time.perf_counter()
    if loaded is None:
        loaded = load(config.model, config.dtype)
    assert loaded.dtype == config.dtype, f"weights are {loaded.dtype}, config wants {config.dtype}"
    source, model, tokenizer = loaded.source, loaded.model, loaded.tokenizer
    kv_format = resolve_kv_format(config.cache.kv_cache_dtype, TORCH_DTYPES[config.dtype])
    model_config = model.config
    block_size = config.cache.block_size
    block_bytes = bytes_per_block(model_config, block_size, kv_format.pool_dtype)
    num_blocks = config.cache.num_blocks or num_blocks_for_budget(
        config.cache.memory_budget_bytes, block_bytes
    )
    kv_cache = allocate_kv_cache(model_config, num_blocks, block_size, kv_format.pool_dtype)
    tiers = None
    if config.cache.enable_prefix_caching:
        tiers = build_tiers(config.cache, kv_cache, source.model_id)
    kv = KVCacheManager(
        num_blocks,
        block_size,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        extra_keys=make_extra_keys(source.model_id),
        tiers=tiers,
    )
    backend = get_backend(config.attention_backend, "cpu")
    runner = ModelRunner(model_config, model, kv_cache, block_size, attention_backend=backend)
    max_model_len = min(model_config.max_context_tokens, config.max_model_len or 1 << 62)
    log.info(
        "loaded %s (%s, %d layers) in %.1fs; KV pool (%s) %d blocks x %d tokens = %.2f GiB",
        source.model_id,
        config.dtype,
        model_config.num_layers,
        time.perf_counter() - started,
        kv_format.name,
        num_blocks,
        block_size,
        num_blocks * block_bytes / 2**30,
    )
    return WorkerState(source, model_config, tokenizer, kv, runner, max_model_len, tiers)
