"""Peer fetch through real worker processes: two prefill workers and a decode worker over
real gRPC and real NIXL. The second prefill worker pulls a prompt prefix the first one holds
(in its pool, or loaded back from its host tier), only the blocks it lacks, and the greedy
tokens equal transformers'. A fetch that fails (the holder lacks the blocks, the holder is
gone) is computed instead, with the same tokens, a log line and a count.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.proto import worker_pb2
from pdserve.worker.cluster_secret import ClusterSecret
from tests.integration.worker_procs import (
    DisaggResult,
    WorkerProc,
    greedy,
    launch_worker,
    run_disaggregated,
    running,
    wait_for,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
BLOCK = 16
PREFIX_BLOCKS = 20
COMMON = ("--kv-backend", "nixl", "--transfer-timeout-s", "10")
HOLDER_BLOCKS = 96  # small: a filler prompt pushes a prefix out into the host tier
FETCHER_BLOCKS = 96
# fp32 block: layers x K/V x block x kv heads x head dim x 4 bytes
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4


def _story(topic: str) -> str:
    return " ".join(
        f"Entry {i}: the {topic} log notes item {i * 7 % 11} was moved." for i in range(60)
    )


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any) -> dict[str, list[int]]:
    enc = smollm2_tokenizer.encode
    prefixes = {
        t: enc(_story(t))[: PREFIX_BLOCKS * BLOCK] for t in ("harbour", "orchard", "quarry", "mill")
    }
    assert all(len(p) == PREFIX_BLOCKS * BLOCK for p in prefixes.values())
    harbour, orchard, quarry, mill = (prefixes[t] for t in ("harbour", "orchard", "quarry", "mill"))
    filler = enc(" ".join(f"Crate {i} held {i * 3 % 17} pears." for i in range(400)))
    return {
        "holder": harbour + enc(" What was moved first?"),
        "fetcher_part": harbour[: 8 * BLOCK] + enc(" Which log is this?"),
        "fetched": harbour + enc(" Summarise the log in one line."),
        "not_held": orchard + enc(" What was moved last?"),
        "holder_gone": quarry + enc(" Name one item."),
        "tier_first": mill + enc(" How many entries are there?"),
        "tier_fetched": mill + enc(" Which item came up most?"),
        "filler": filler[: (HOLDER_BLOCKS - 8) * BLOCK],
    }


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProc]]:
    """Members of one cluster (its secret): every call, the FetchKV between the two prefill
    workers included, goes over mutual TLS, and every KV connection is authenticated."""
    tmp: Path = tmp_path_factory.mktemp("peer_fetch")
    secret = ClusterSecret.generate()
    launched = [
        launch_worker(
            "prefill-a", "prefill", tmp, *COMMON, "--num-blocks", str(HOLDER_BLOCKS),
            "--kv-host-tier-bytes", "128MiB", secret=secret,
        ),
        launch_worker("prefill-b", "prefill", tmp, *COMMON, "--num-blocks", str(FETCHER_BLOCKS),
                      secret=secret),
        launch_worker("decode", "decode", tmp, *COMMON, "--num-blocks", "256", secret=secret),
    ]  # fmt: skip
    with running(launched) as workers:
        yield {w.name: w for w in workers}


@pytest.fixture(scope="module")
def transformers_greedy(hf_smollm2: Any, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    out = {}
    with torch.inference_mode():
        for name, prompt in prompts.items():
            if name in ("filler", "fetcher_part"):
                continue
            generated = hf_smollm2.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False
            )
            out[name] = generated[0, len(prompt) :].tolist()
    return out


def _peer(holder: WorkerProc, num_blocks: int, address: str = "") -> worker_pb2.PeerPrefix:
    return worker_pb2.PeerPrefix(
        worker_id=holder.name, address=address or holder.address, num_blocks=num_blocks
    )


def _run(
    procs: dict[str, WorkerProc],
    prefill: str,
    name: str,
    prompts: dict[str, list[int]],
    peer: worker_pb2.PeerPrefix | None = None,
) -> DisaggResult:
    prompt = prompts[name]
    return run_disaggregated(
        procs[prefill],
        procs["decode"],
        f"peer-{name}",
        prompt,
        greedy(MAX_TOKENS),
        peer_prefix=peer,
    )


def _delta(after: Any, before: Any, *fields: str) -> tuple[int, ...]:
    return tuple(getattr(after, f) - getattr(before, f) for f in fields)


FETCH_FIELDS = ("peer_fetches", "peer_fetched_blocks", "peer_fetched_bytes", "recompute_fallbacks")


def test_the_second_prefill_worker_fetches_only_the_blocks_it_lacks(
    procs: dict[str, WorkerProc],
    prompts: dict[str, list[int]],
    transformers_greedy: dict[str, list[int]],
) -> None:
    a, b = procs["prefill-a"], procs["prefill-b"]
    assert _run(procs, "prefill-a", "holder", prompts).token_ids == transformers_greedy["holder"]
    _run(procs, "prefill-b", "fetcher_part", prompts)  # b now holds the first 8 prefix blocks
    a_before, b_before = a.stats(), b.stats()

    result = _run(procs, "prefill-b", "fetched", prompts, _peer(a, PREFIX_BLOCKS))
    assert result.token_ids == transformers_greedy["fetched"]
    a_after, b_after = a.stats(), b.stats()
    moved = PREFIX_BLOCKS - 8
    assert _delta(b_after, b_before, *FETCH_FIELDS) == (1, moved, moved * BLOCK_BYTES, 0)
    assert _delta(a_after, a_before, "peer_served_blocks") == (moved,)
    # The fetched blocks are prefix hits of b's prefill: it computed only the question.
    assert _delta(b_after, b_before, "prefix_hit_tokens") == (PREFIX_BLOCKS * BLOCK,)
    assert _delta(a_after, a_before, "prefix_hit_tokens", "prompt_tokens") == (0, 0)


@pytest.mark.parametrize(
    ("name", "address", "why"),
    [
        ("not_held", "", "holds 0 of the 20 blocks"),  # the holder lacks the blocks
        ("holder_gone", "127.0.0.1:1", "FetchKV -> UNAVAILABLE"),  # nothing listens there
    ],
)
def test_a_failed_fetch_is_computed_instead(
    procs: dict[str, WorkerProc],
    prompts: dict[str, list[int]],
    transformers_greedy: dict[str, list[int]],
    name: str,
    address: str,
    why: str,
) -> None:
    a, b = procs["prefill-a"], procs["prefill-b"]
    before = b.stats()
    result = _run(procs, "prefill-b", name, prompts, _peer(a, PREFIX_BLOCKS, address))
    assert result.token_ids == transformers_greedy[name]
    assert _delta(b.stats(), before, *FETCH_FIELDS) == (0, 0, 0, 1)
    log = b.log_tail(200)
    assert why in log and "computing them instead" in log


def test_the_holder_loads_blocks_back_from_its_host_tier_to_send_them(
    procs: dict[str, WorkerProc],
    prompts: dict[str, list[int]],
    transformers_greedy: dict[str, list[int]],
) -> None:
    a, b = procs["prefill-a"], procs["prefill-b"]
    first = _run(procs, "prefill-a", "tier_first", prompts)
    assert first.token_ids == transformers_greedy["tier_first"]
    _run(procs, "prefill-a", "filler", prompts)  # pushes the mill prefix out of a's pool
    before_a, before_b = a.stats(), b.stats()
    result = _run(procs, "prefill-b", "tier_fetched", prompts, _peer(a, PREFIX_BLOCKS))
    assert result.token_ids == transformers_greedy["tier_fetched"]
    after_a, after_b = a.stats(), b.stats()
    assert after_a.host_tier.hit_tokens > before_a.host_tier.hit_tokens, "loaded back to send"
    assert _delta(after_b, before_b, "peer_fetches", "recompute_fallbacks") == (1, 0)


def test_no_blocks_leak_on_either_side_of_a_fetch(procs: dict[str, WorkerProc]) -> None:
    for name, total in (("prefill-a", HOLDER_BLOCKS), ("prefill-b", FETCHER_BLOCKS)):
        assert wait_for(lambda n=name, t=total: procs[n].stats().free_blocks == t), name
