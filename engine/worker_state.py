"""Builds what one engine instance owns: weights, tokenizer, the fixed KV pool, the runner."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdserve.engine.attention import get_backend
from pdserve.engine.attention.kv_format import resolve_kv_format
from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_graphs import (
    SCRATCH_BLOCKS,
    DecodeGraphs,
    cuda_graph_factory,
    graph_capture_sizes,
)
from pdserve.engine.device import resolve_device
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


def load(model: str, dtype: str = "float32", device: torch.device | str = "cpu") -> LoadedModel:
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
    source = resolve_model(model)
    weights = load_model(source, dtype=TORCH_DTYPES[dtype])
    return on_device(LoadedModel(source, weights, load_tokenizer(source), dtype), device)


def on_device(loaded: LoadedModel, device: torch.device | str) -> LoadedModel:
    """``loaded`` with its weights on ``device``, moved in place (engines sharing the weights
    share the device too). Weights packed for the CPU's GEMM cannot move to CUDA."""
    device = torch.device(device)
    model = loaded.model
    if model.embed_tokens.weight.device == device:
        return loaded
    if model.native_layers is not None:
        raise ValueError(
            f"the weights of {loaded.source.model_id} are packed for the CPU and cannot move "
            f"to {device}; load them again for that device"
        )
    model.to(device)
    return loaded


def build_worker_state(config: EngineConfig, loaded: LoadedModel | None = None) -> WorkerState:
    """Allocate the KV pool once (it never grows afterwards) around loaded weights.

    ``loaded`` reuses weights already in memory (it must match ``config.model``/``dtype``).
    """
    started = time.perf_counter()
    device = resolve_device(config.device)
    loaded = on_device(loaded or load(config.model, config.dtype), device)
    assert loaded.dtype == config.dtype, f"weights are {loaded.dtype}, config wants {config.dtype}"
    source, model, tokenizer = loaded.source, loaded.model, loaded.tokenizer
    kv_format = resolve_kv_format(config.cache.kv_cache_dtype, TORCH_DTYPES[config.dtype])
    model_config = model.config
    block_size = config.cache.block_size
    block_bytes = bytes_per_block(model_config, block_size, kv_format.pool_dtype)
    num_blocks = config.cache.num_blocks or num_blocks_for_budget(
        config.cache.memory_budget_bytes, block_bytes
    )
    max_model_len = max_model_len_of(config, model_config)
    graphs = _decode_graphs(config, device, max_model_len)
    # The pool's scratch blocks (pad rows of graph replays) are beyond the manager's blocks.
    pool_blocks = num_blocks + (SCRATCH_BLOCKS if graphs is not None else 0)
    kv_cache = allocate_kv_cache(
        model_config, pool_blocks, block_size, kv_format.pool_dtype, device
    )
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
    backend = get_backend(config.attention_backend, device, block_size)
    runner = ModelRunner(
        model_config, model, kv_cache, block_size, device, backend, decode_graphs=graphs
    )
    log.info(
        "loaded %s (%s, %d layers, %s) in %.1fs; KV pool (%s) %d blocks x %d tokens = %.2f GiB",
        source.model_id,
        config.dtype,
        model_config.num_layers,
        device,
        time.perf_counter() - started,
        kv_format.name,
        num_blocks,
        block_size,
        num_blocks * block_bytes / 2**30,
    )
    return WorkerState(source, model_config, tokenizer, kv, runner, max_model_len, tiers)


def max_model_len_of(config: EngineConfig, model_config: ModelConfig) -> int:
    """The context an engine serves: the model's, or less when the config says so."""
    return min(model_config.max_context_tokens, config.max_model_len or 1 << 62)


def _decode_graphs(
    config: EngineConfig, device: torch.device, max_model_len: int
) -> DecodeGraphs | None:
    """CUDA graphs for decode steps where they are asked for and can run (a CUDA device)."""
    if not config.cuda_graphs or device.type != "cuda":
        return None
    sizes = graph_capture_sizes(config.scheduler.max_num_seqs)
    return DecodeGraphs(sizes, cuda_graph_factory(), max_model_len)
