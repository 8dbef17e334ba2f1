"""Greedy output is unchanged (fp32) when a prompt's prefix blocks were evicted from a tiny
pool and come back from the host tier (kept exact, or as int8), from the disk tier, and from
the disk tier a new engine indexes at start; in bf16 from the host tier (exact and int8);
the tier counters show the hits. The KV events follow the blocks between tiers, and a
restarted worker's disk tier reaches the locality index (a real redis-server) under its new
epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from pdserve.cluster.locality_index import LocalityIndex
from pdserve.cluster.redis_server import RedisServer
from pdserve.cluster.registry import WorkerRegistry
from pdserve.cluster.worker_agent import AgentConfig, WorkerAgent, start_worker_agent
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv_cache import BlockHash, BlocksRemoved, BlocksStored, KVTier
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.packed_gemm import gemm_for
from pdserve.engine.worker_state import LoadedModel
from pdserve.proto.redis_keys import RedisKeys
from pdserve.proto.workers import WorkerInfo, WorkerLoad, WorkerRole
from pdserve.router.policies import PrefixHit
from pdserve.router.state.locality import engine_prompt_hasher

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
POOL = {"num_blocks": 40, "block_size": 16}  # 640 token slots
HOST_BYTES = 64 * 740_000  # room for 64 exact fp32 blocks of the default model
PREFIX_TOKENS = 320  # 20 blocks, shared by the two questions
FILLER_TOKENS = 624  # + 16 new tokens = all 40 blocks: evicts the whole prefix


@pytest.fixture(scope="module")
def loaded(default_model_source: Any, smollm2_model: Any, smollm2_tokenizer: Any) -> LoadedModel:
    return LoadedModel(default_model_source, smollm2_model, smollm2_tokenizer, "float32")


def _ids(tokenizer: Any, text: str, num_tokens: int) -> list[int]:
    ids = tokenizer.encode(text)
    assert len(ids) >= num_tokens, f"the text gives {len(ids)} tokens, want {num_tokens}"
    return ids[:num_tokens]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any) -> dict[str, list[int]]:
    story = " ".join(
        f"Day {i}: the keeper logged the ships, trimmed the wick and watched the tide."
        for i in range(40)
    )
    filler = " ".join(f"Item {i}: a crate of {i * 7 % 13} pears left the dock." for i in range(90))
    prefix = _ids(smollm2_tokenizer, story, PREFIX_TOKENS)
    return {
        "first": prefix + smollm2_tokenizer.encode(" What did the keeper log on day 3?"),
        "second": prefix + smollm2_tokenizer.encode(" Summarise the keeper's evenings."),
        "filler": _ids(smollm2_tokenizer, filler, FILLER_TOKENS),
    }


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel, prompts: dict[str, list[int]]) -> list[int]:
    """The second question's tokens computed from scratch (no cache, no tiers)."""
    llm = LLM(loaded=loaded, enable_prefix_caching=False, **POOL)
    return llm.generate([prompts["second"]], GREEDY)[0].token_ids


def _evict_then_ask(llm: LLM, prompts: dict[str, list[int]]) -> list[int]:
    """Cache the prefix, push it out of the pool with the filler, ask the second question:
    every prefix token is a hit, none of them from the pool."""
    llm.generate([prompts["first"]], GREEDY)
    llm.generate([prompts["filler"]], GREEDY)
    hits_before = llm.engine.scheduler.stats().prefix_hit_tokens
    assert not llm.engine.kv.lookup_prefix(prompts["first"][:PREFIX_TOKENS]).block_ids
    tokens = llm.generate([prompts["second"]], GREEDY)[0].token_ids
    assert llm.engine.scheduler.stats().prefix_hit_tokens - hits_before == PREFIX_TOKENS
    return tokens


@pytest.mark.parametrize("codec", ["exact", "int8"])
def test_prefix_back_from_host_memory_changes_no_token(
    loaded: LoadedModel, prompts: dict[str, list[int]], reference: list[int], codec: str
) -> None:
    """int8 is not bit-exact: on this prompt its tokens are the same all the same."""
    llm = LLM(loaded=loaded, host_tier_bytes=HOST_BYTES, tier_codec=codec, **POOL)
    assert _evict_then_ask(llm, prompts) == reference
    stats = llm.engine.tier_stats()
    assert stats.host_hit_tokens == PREFIX_TOKENS, stats
    assert stats.disk_hit_tokens == 0 and stats.host_stored_blocks > 0


def test_prefix_back_from_disk_and_after_a_restart_changes_no_token(
    loaded: LoadedModel, prompts: dict[str, list[int]], reference: list[int], tmp_path: Path
) -> None:
    tiers = {"host_tier_bytes": 0, "disk_tier_path": str(tmp_path), "disk_tier_bytes": 10**9}
    llm = LLM(loaded=loaded, **tiers, **POOL)
    assert _evict_then_ask(llm, prompts) == reference
    stats = llm.engine.tier_stats()
    assert stats.disk_hit_tokens == PREFIX_TOKENS and stats.host_hit_tokens == 0, stats
    assert stats.disk_stored_blocks > 0 and stats.disk_bytes_in > 0

    restarted = LLM(loaded=loaded, **tiers, **POOL)
    tokens = restarted.generate([prompts["second"]], GREEDY)[0].token_ids
    assert tokens == reference
    assert restarted.engine.tier_stats().disk_hit_tokens == PREFIX_TOKENS


@pytest.mark.parametrize("codec", ["exact", "int8"])
def test_bf16_prefix_back_from_host_memory_changes_no_token(
    default_model_source: Any, smollm2_tokenizer: Any, prompts: dict[str, list[int]], codec: str
) -> None:
    """The blocks come back into a bf16 pool. The reference is the same engine without
    tiers on the second prompt alone (after the filler it would recompute it all the same),
    computing the whole prompt where the tiered one computes only its tail: the same tokens
    need linears whose rows do not depend on the batch (as in test_engine_greedy's bf16
    test)."""
    if gemm_for(torch.bfloat16) is None:
        pytest.skip("no AMX or AVX-512 BF16 here: bf16 linears are oneDNN's, not batch-invariant")
    weights = load_model(default_model_source, dtype=torch.bfloat16, show_progress=False)
    loaded = LoadedModel(default_model_source, weights, smollm2_tokenizer, "bfloat16")
    bf16 = {"loaded": loaded, "dtype": "bfloat16", **POOL}
    without_tiers = LLM(**bf16).generate([prompts["second"]], GREEDY)[0].token_ids
    llm = LLM(host_tier_bytes=HOST_BYTES, tier_codec=codec, **bf16)
    assert _evict_then_ask(llm, prompts) == without_tiers
    assert llm.engine.tier_stats().host_hit_tokens == PREFIX_TOKENS


def test_int8_pool_prefix_back_from_host_memory_and_disk_changes_no_token(
    loaded: LoadedModel, prompts: dict[str, list[int]], tmp_path: Path
) -> None:
    """An int8 pool's blocks go to the tiers and come back as they were stored, so the
    prefix read back gives the tokens the same int8 engine computes from scratch."""
    int8 = {"loaded": loaded, "kv_cache_dtype": "int8", **POOL}
    without_tiers = LLM(enable_prefix_caching=False, **int8)
    reference = without_tiers.generate([prompts["second"]], GREEDY)[0].token_ids
    host = LLM(host_tier_bytes=HOST_BYTES, **int8)
    assert _evict_then_ask(host, prompts) == reference
    assert host.engine.tier_stats().host_hit_tokens == PREFIX_TOKENS
    disk = LLM(host_tier_bytes=0, disk_tier_path=str(tmp_path), **int8)
    assert _evict_then_ask(disk, prompts) == reference
    assert disk.engine.tier_stats().disk_hit_tokens == PREFIX_TOKENS


def _prefix_tiers(llm: LLM, prefix_hashes: list[BlockHash]) -> set[KVTier]:
    """Where the engine's KV events (drained now) last put each of ``prefix_hashes``."""
    where: dict[BlockHash, KVTier | None] = {}
    for event in llm.engine.kv.drain_events():
        if isinstance(event, BlocksStored):
            where |= dict.fromkeys(event.block_hashes, event.tier)
        elif isinstance(event, BlocksRemoved):
            where |= dict.fromkeys(event.block_hashes, None)
    return {where[h] for h in prefix_hashes if h in where}  # type: ignore[misc]


def _agent(redis_url: str, keys: RedisKeys, llm: LLM) -> WorkerAgent:
    """The worker's Redis agent over an engine this test steps itself (never meanwhile)."""
    kv = llm.engine.kv
    info = WorkerInfo("prefill-0", WorkerRole.PREFILL, "127.0.0.1:1", "m", kv.num_blocks, 16)
    config = AgentConfig(key_prefix=keys.prefix, lease_s=30.0, heartbeat_s=5.0)
    return start_worker_agent(
        redis_url, info, WorkerLoad, kv.drain_events, kv.cached_blocks, config
    )


def test_a_restarted_worker_republishes_its_disk_tier_with_its_new_epoch(
    loaded: LoadedModel,
    prompts: dict[str, list[int]],
    tmp_path: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    keys: RedisKeys,
) -> None:
    """Blocks move pool -> disk -> pool in the KV events; a new engine on the same disk
    directory publishes them, on disk, under the new epoch of the worker's id."""
    tiers = {"host_tier_bytes": 0, "disk_tier_path": str(tmp_path), "disk_tier_bytes": 10**9}
    llm = LLM(loaded=loaded, **tiers, **POOL)
    prefix = engine_prompt_hasher(loaded.source.model_id)(prompts["first"][:PREFIX_TOKENS])
    assert len(prefix) == PREFIX_TOKENS // 16
    llm.generate([prompts["first"]], GREEDY)
    assert _prefix_tiers(llm, prefix) == {KVTier.POOL}
    llm.generate([prompts["filler"]], GREEDY)
    assert _prefix_tiers(llm, prefix) == {KVTier.DISK}, "evicted from the pool onto disk"
    llm.generate([prompts["second"]], GREEDY)
    assert _prefix_tiers(llm, prefix) == {KVTier.POOL}, "loaded back"
    del llm

    index = LocalityIndex(redis_client, keys)
    restarted = LLM(loaded=loaded, **tiers, **POOL)
    agent = _agent(redis_server.url, keys, restarted)
    try:
        hit = index.longest_prefix(prefix, ["prefill-0"])["prefill-0"]
        assert hit == PrefixHit(len(prefix), disk_blocks=len(prefix))
        assert WorkerRegistry(redis_client, keys).get("prefill-0").epoch == agent.epoch  # type: ignore[union-attr]
    finally:
        agent.stop()
