"""`pdserve up` with 1 prefill + 1 decode worker: real Ray, redis-server, worker actors with the
real model, two router processes sharing the ports (``--router-processes 2``) on loopback.
Greedy answers over OpenAI HTTP (the official ``openai`` client) and gRPC must equal the
offline engine (``engine.LLM``) token for token; both router processes must serve; `pdserve
status` must describe the cluster; SIGTERM must stop every process it started.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pdserve.cluster.locality_index import LocalityIndex
from pdserve.cluster.registry import WorkerRegistry
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto.redis_keys import RedisKeys
from pdserve.router.observe.goodput_store import read_goodput
from pdserve.router.state.locality import engine_prompt_hasher
from tests.integration.cluster_proc import (
    UpProcess,
    alive,
    descendants,
    grpc_generate,
    redis_client,
    start_up,
    wait_until,
)
from tests.integration.worker_procs import offline_llm

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 16
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "A library catalogue lists books by author, title and shelf. The atlases are kept on "
    "the third shelf, next to the old maps of the harbour, and the bee books are",
)
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    proc = start_up(
        tmp_path_factory.mktemp("cluster_up"),
        *("--prefill", "1", "--decode", "1", "--router-processes", "2"),
    )
    try:
        offline_llm()  # load the reference while the cluster starts
        proc.wait_serving()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def reference() -> Any:
    return offline_llm()


def greedy_offline(llm: Any, prompt: str | list[int]) -> Any:
    return llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]


def test_openai_http_answers_equal_the_offline_engine(up: UpProcess, reference: Any) -> None:
    client = openai.OpenAI(base_url=up.http_url + "/v1", api_key="unused", max_retries=0)
    for prompt in PROMPTS:
        expected = greedy_offline(reference, prompt)
        got = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
        )
        assert got.choices[0].text == expected.text, prompt
        assert got.usage is not None and got.usage.completion_tokens == len(expected.token_ids)
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, stream=True
    )
    assert (
        "".join(c.choices[0].text for c in streamed) == greedy_offline(reference, PROMPTS[0]).text
    )
    chat_ids = reference.tokenizer.apply_chat_template(CHAT)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    assert chat.choices[0].message.content == greedy_offline(reference, chat_ids).text


def test_grpc_answers_equal_the_offline_engine_token_for_token(
    up: UpProcess, reference: Any
) -> None:
    for prompt in PROMPTS:
        ids = reference.tokenizer.encode(prompt)
        expected = greedy_offline(reference, ids)
        got = grpc_generate(up.grpc_address, ids, MAX_TOKENS)
        assert got.token_ids == expected.token_ids, prompt
        assert got.text == expected.text
        # disaggregated: the prompt ran on the prefill worker, the rest on the decode worker
        assert (got.prefill_worker, got.decode_worker) == ("prefill-0", "decode-0")


def test_prompt_blocks_reach_the_locality_index(up: UpProcess, reference: Any) -> None:
    ids = reference.tokenizer.encode(PROMPTS[2])
    grpc_generate(up.grpc_address, ids, 2)
    hashes = list(engine_prompt_hasher(MODEL)(ids))
    assert len(hashes) >= 2, "the prompt must span full blocks"
    client = redis_client(up)
    index = LocalityIndex(client, RedisKeys(up.state["key_prefix"]))
    deadline = time.monotonic() + 10
    while index.longest_prefix(hashes, ["prefill-0"])["prefill-0"].blocks < len(hashes):
        assert time.monotonic() < deadline, "the prefill worker's blocks never got indexed"
        time.sleep(0.1)
    client.close()


def test_both_router_processes_serve_and_publish_goodput(up: UpProcess) -> None:
    pids = up.state["router_pids"]
    assert len(pids) == 2 and pids[0] == up.process.pid and all(alive(p) for p in pids)
    # The kernel spreads connections over the processes: each call below opens its own.
    for _ in range(12):
        assert grpc_generate(up.grpc_address, [1, 2, 3], 2).finish_reason == "length"
    client = redis_client(up)

    def serving_routers() -> set[int]:
        stored = read_goodput(client, up.state["key_prefix"])
        return {
            pid
            for pid in pids
            for router in stored
            if router.router_id.endswith(f"-{pid}") and router.windows[-1].requests > 0
        }

    wait_until(lambda: serving_routers() == set(pids), 15, "goodput from both router processes")
    client.close()


def test_status_shows_pools_workers_and_index(up: UpProcess) -> None:
    status = up.status()
    assert status["targets"] == {"prefill": 1, "decode": 1, "colocated": 0}
    assert status["live"] == {"prefill": 1, "decode": 1, "colocated": 0}
    rows = {w["worker_id"]: w for w in status["workers"]}
    assert set(rows) == {"prefill-0", "decode-0"}
    client = redis_client(up)
    registry = WorkerRegistry(client, RedisKeys(up.state["key_prefix"]))
    for worker_id, row in rows.items():
        info = registry.get(worker_id)
        assert info is not None
        assert (row["role"], row["address"], row["epoch"]) == (
            info.role.value,
            info.address,
            info.epoch,
        )
        assert row["total_blocks"] == 256 and 0 <= row["kv_usage"] <= 1
        assert alive(row["pid"])
    client.close()
    assert rows["prefill-0"]["indexed_blocks"] >= 2  # the long prompts above
    assert status["index_blocks"] >= rows["prefill-0"]["indexed_blocks"]
    text = up.cli("status")
    assert text.returncode == 0, text.stderr
    for needle in ("prefill-0", "decode-0", "EPOCH", "KV USED", "index:", "1 live / 1 target"):
        assert needle in text.stdout, text.stdout


def test_sigterm_stops_everything_without_orphans(up: UpProcess) -> None:
    tree = descendants(up.process.pid)
    names = " ".join(tree.values())
    assert set(up.state["router_pids"][1:]) <= set(tree), "the second router process"
    for part in ("redis-server", "raylet", "gcs_server", "WorkerActor"):
        assert part in names, f"{part} not among the children: {names}"
    assert up.stop() == 0, up.tail()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {p: tree[p] for p in tree if alive(p)}
    assert not left, f"orphans after SIGTERM: {left}"
    assert not Path(up.state_file).exists()
