"""Building an engine's speculator: the proposer its config names, with a draft model's pool."""

from __future__ import annotations

import logging

import torch

from pdserve.engine.attention import get_backend
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.model.registry import resolve_model
from pdserve.engine.runner import ModelRunner, allocate_kv_cache
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.speculative.draft import DraftModelProposer
from pdserve.engine.speculative.ngram import NgramProposer
from pdserve.engine.speculative.speculator import Proposer, Speculator
from pdserve.engine.worker_state import TORCH_DTYPES, LoadedModel, load

log = logging.getLogger(__name__)


def build_speculator(
    config: SpeculativeConfig,
    target: LoadedModel,
    block_size: int,
    attention_backend: str,
    max_model_len: int,
    device: torch.device | str = "cpu",
) -> Speculator | None:
    """None when speculation is off. A draft model named like the target reuses its weights
    (the model as its own draft: every candidate is accepted; for tests and checks)."""
    if not config.enabled:
        return None
    proposer: Proposer
    if config.method == "ngram":
        proposer = NgramProposer(config)
    else:
        proposer = _draft_proposer(
            config, target, block_size, attention_backend, max_model_len, torch.device(device)
        )
    log.info(
        "speculative decoding: %s, up to %d tokens deep, %d per tree, %d per step",
        config.method if config.method == "ngram" else f"draft model {config.draft_model}",
        config.num_speculative_tokens,
        config.max_tree_nodes,
        config.max_verify_tokens,
    )
    return Speculator(config, proposer)


def _draft_proposer(
    config: SpeculativeConfig,
    target: LoadedModel,
    block_size: int,
    attention_backend: str,
    max_model_len: int,
    device: torch.device,
) -> DraftModelProposer:
    assert config.draft_model is not None, "draft method without a draft model"
    same = resolve_model(config.draft_model).model_id == target.source.model_id
    draft = target if same else load(config.draft_model, target.dtype, device)
    if draft.model.config.vocab_size != target.model.config.vocab_size:
        raise ValueError(
            f"draft model {config.draft_model!r} has a vocabulary of "
            f"{draft.model.config.vocab_size} tokens, the target {target.source.model_id!r} "
            f"{target.model.config.vocab_size}: a draft must share the target's tokenizer"
        )
    model_config = draft.model.config
    pool = allocate_kv_cache(
        model_config, config.draft_num_blocks, block_size, TORCH_DTYPES[target.dtype], device
    )
    runner = ModelRunner(
        model_config,
        draft.model,
        pool,
        block_size,
        device,
        get_backend(attention_backend, device, block_size),
    )
    kv = KVCacheManager(config.draft_num_blocks, block_size, enable_prefix_caching=False)
    draft_len = min(max_model_len, model_config.max_context_tokens)
    return DraftModelProposer(runner, kv, draft_len)
