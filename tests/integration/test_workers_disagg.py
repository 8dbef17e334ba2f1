"""Prefill worker -> decode worker over real gRPC and real NIXL, in separate processes.

Greedy outputs must equal the offline engine (``engine.LLM``) and transformers' greedy
``generate`` on the same GGUF, token for token. The prompts are sent in an order that makes
prefix hits happen on both sides: on the prefill worker (the same prefix twice) and on the
decode worker (blocks already there: ``num_present_blocks > 0``, fewer blocks sent, or
none at all). The colocated worker's Generate must equal the offline engine too.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import worker_pb2
from tests.integration.worker_procs import (
    DisaggResult,
    WorkerProc,
    greedy,
    launch_worker,
    offline_llm,
    run_disaggregated,
    run_generate,
    running,
    wait_for,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
WORKER_ARGS = ("--num-blocks", "128", "--kv-backend", "nixl", "--transfer-timeout-s", "10")
SYSTEM = (
    "You are a careful assistant for a small library. Answer in one short sentence, name "
    "the shelf when you know it, and never invent a book that the catalogue does not hold."
)
TEXT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Write a haiku about the sea. Waves fold into foam, and the tide keeps its own slow "
    "count of the hours while gulls argue over the",
    "Hello",
)
SHARED_PREFIX_QUESTIONS = ("Where are the atlases?", "Do you have a book about bees?")
EXACT_BLOCKS_TOKENS = 32  # two full blocks: sent twice, the second time nothing moves


@dataclass(frozen=True)
class Case:
    name: str
    prompt: list[int]


def _cases(tokenizer: Any) -> list[Case]:
    cases = [Case(f"text{i}", tokenizer.encode(t)) for i, t in enumerate(TEXT_PROMPTS)]
    chat = [{"role": "user", "content": "What is the tallest mountain in the world?"}]
    cases.append(Case("chat", tokenizer.apply_chat_template(chat)))
    for i, question in enumerate(SHARED_PREFIX_QUESTIONS):
        text = f"{SYSTEM}\nQuestion: {question}\nAnswer:"
        cases.append(Case(f"shared{i}", tokenizer.encode(text)))
    exact = tokenizer.encode(SYSTEM + " " + TEXT_PROMPTS[2])[:EXACT_BLOCKS_TOKENS]
    cases += [Case("exact_first", exact), Case("exact_again", exact)]
    return cases


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProc]]:
    """Launched first so the workers load while this process builds its references."""
    tmp: Path = tmp_path_factory.mktemp("workers_disagg")
    launched = [
        launch_worker("prefill-nixl", "prefill", tmp, *WORKER_ARGS),
        launch_worker("decode-nixl", "decode", tmp, *WORKER_ARGS),
        launch_worker("colocated", "colocated", tmp, *WORKER_ARGS),
    ]
    with running(launched) as workers:
        yield {w.role: w for w in workers}


@pytest.fixture(scope="module")
def cases(smollm2_tokenizer: Any) -> list[Case]:
    return _cases(smollm2_tokenizer)


@pytest.fixture(scope="module")
def offline(cases: list[Case]) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outputs = offline_llm().generate([c.prompt for c in cases], params)
    return {c.name: out.token_ids for c, out in zip(cases, outputs, strict=True)}


@pytest.fixture(scope="module")
def transformers_greedy(hf_smollm2: Any, cases: list[Case]) -> dict[str, list[int]]:
    out = {}
    with torch.inference_mode():
        for case in cases:
            ids = torch.tensor([case.prompt])
            generated = hf_smollm2.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
            out[case.name] = generated[0, len(case.prompt) :].tolist()
    return out


@dataclass
class Run:
    result: DisaggResult
    prefill_hit_tokens: int  # prefix-cache hit on the prefill worker for this request


@pytest.fixture(scope="module")
def disagg_runs(
    procs: dict[str, WorkerProc],
    cases: list[Case],
    offline: dict[str, list[int]],
    transformers_greedy: dict[str, list[int]],
) -> dict[str, Run]:
    """Every case through prefill -> decode, one after another, in the order of ``cases``."""
    prefill, decode = procs["prefill"], procs["decode"]
    runs = {}
    for case in cases:
        before = prefill.stats().prefix_hit_tokens
        result = run_disaggregated(
            prefill, decode, f"disagg-{case.name}", case.prompt, greedy(MAX_TOKENS)
        )
        runs[case.name] = Run(result, prefill.stats().prefix_hit_tokens - before)
    return runs


def test_disaggregated_greedy_equals_offline_engine_and_transformers(
    cases: list[Case],
    disagg_runs: dict[str, Run],
    offline: dict[str, list[int]],
    transformers_greedy: dict[str, list[int]],
) -> None:
    assert len(cases) >= 8
    for case in cases:
        got = disagg_runs[case.name].result.token_ids
        assert got == offline[case.name], f"{case.name}: disaggregated != offline engine"
        assert got == transformers_greedy[case.name], f"{case.name}: != transformers"


def test_text_streams_whole_across_the_two_workers(
    cases: list[Case], disagg_runs: dict[str, Run], smollm2_tokenizer: Any
) -> None:
    """The prefill worker's first-token text + the decode worker's text = the whole text."""
    for case in cases:
        result = disagg_runs[case.name].result
        assert result.text == smollm2_tokenizer.decode(result.token_ids), case.name
        assert result.finish_reason in ("stop", "length"), case.name


def test_every_transfer_sends_exactly_the_blocks_the_decode_worker_lacks(
    cases: list[Case], disagg_runs: dict[str, Run]
) -> None:
    for case in cases:
        result = disagg_runs[case.name].result
        dest, report = result.destination, result.report
        assert report is not None and report.ok, (case.name, report)
        assert len(dest.block_ids) == -(-len(case.prompt) // 16), case.name
        assert report.blocks_skipped == dest.num_present_blocks, case.name
        assert report.blocks_sent == len(dest.block_ids) - dest.num_present_blocks, case.name
        block_bytes = 30 * 2 * 16 * 3 * 64 * 4  # layers, K/V, block, kv heads, head dim, fp32
        assert report.bytes == report.blocks_sent * block_bytes, case.name


def test_prefix_hits_on_the_decode_worker_skip_blocks(disagg_runs: dict[str, Run]) -> None:
    first, second = disagg_runs["shared0"].result, disagg_runs["shared1"].result
    assert first.destination.num_present_blocks == 0
    assert second.destination.num_present_blocks >= 2, "the shared system prompt is cached"
    assert second.report is not None and second.report.blocks_skipped >= 2
    again = disagg_runs["exact_again"].result
    assert again.destination.num_present_blocks == len(again.destination.block_ids) == 2
    assert again.report is not None and (again.report.blocks_sent, again.report.bytes) == (0, 0)


def test_prefix_hits_on_the_prefill_worker(disagg_runs: dict[str, Run]) -> None:
    assert disagg_runs["shared0"].prefill_hit_tokens == 0
    assert disagg_runs["shared1"].prefill_hit_tokens >= 32
    # The last token is always computed, so an all-cached prompt reuses all but one block.
    assert disagg_runs["exact_again"].prefill_hit_tokens == EXACT_BLOCKS_TOKENS - 16


def test_a_first_token_that_ends_the_request_needs_no_decode(
    procs: dict[str, WorkerProc], cases: list[Case], offline: dict[str, list[int]]
) -> None:
    """Like the router: the decode worker's reservation is cancelled; it is freed once its
    transfer could no longer arrive (the receiver's timeout fails the expectation)."""
    prefill, decode = procs["prefill"], procs["decode"]
    failed_before = decode.stats().transfers_failed
    case = cases[0]
    result = run_disaggregated(prefill, decode, "one-token", case.prompt, greedy(1))
    assert (result.token_ids, result.finish_reason) == (offline[case.name][:1], "length")
    assert wait_for(lambda: prefill.stats().free_blocks == 128), "held prompt KV released"
    assert wait_for(lambda: decode.stats().free_blocks == 128, timeout_s=60)
    assert decode.stats().transfers_failed == failed_before + 1


def test_colocated_generate_equals_offline_engine(
    procs: dict[str, WorkerProc], cases: list[Case], offline: dict[str, list[int]]
) -> None:
    for case in cases:
        tokens, _ = run_generate(
            procs["colocated"], f"colo-{case.name}", case.prompt, greedy(MAX_TOKENS)
        )
        assert tokens == {0: offline[case.name]}, case.name


def test_concurrent_requests_share_the_workers_batches(
    procs: dict[str, WorkerProc], cases: list[Case], offline: dict[str, list[int]]
) -> None:
    """Several requests in flight at once: the decode worker batches them continuously."""
    chosen = [c for c in cases if c.name in ("text0", "text1", "chat", "shared0")]
    with concurrent.futures.ThreadPoolExecutor(len(chosen)) as pool:
        futures = {
            c.name: pool.submit(
                run_disaggregated,
                procs["prefill"],
                procs["decode"],
                f"concurrent-{c.name}",
                c.prompt,
                greedy(MAX_TOKENS),
            )
            for c in chosen
        }
        results = {name: f.result() for name, f in futures.items()}
    for name, result in results.items():
        assert result.token_ids == offline[name], name


def test_colocated_generate_with_n_2_streams_both_sequences(
    procs: dict[str, WorkerProc], cases: list[Case], offline: dict[str, list[int]]
) -> None:
    case = cases[0]
    tokens, _ = run_generate(procs["colocated"], "colo-n2", case.prompt, greedy(MAX_TOKENS, n=2))
    assert tokens == {0: offline[case.name], 1: offline[case.name]}


def test_no_blocks_leak_and_transfers_are_counted(
    procs: dict[str, WorkerProc], cases: list[Case], disagg_runs: dict[str, Run]
) -> None:
    sent = sum(r.result.report.bytes for r in disagg_runs.values() if r.result.report)
    for role in ("prefill", "decode", "colocated"):
        # A cancelled reservation is freed once its transfer could no longer arrive.
        assert wait_for(lambda r=role: procs[r].stats().free_blocks == 128)
        stats = procs[role].stats()
        assert (stats.running, stats.waiting, stats.total_blocks) == (0, 0, 128), role
        assert stats.role == role and stats.worker_id == procs[role].name and stats.epoch > 0
    prefill, decode = procs["prefill"].stats(), procs["decode"].stats()
    # Both ends count the same bytes; other tests in this module may have added some.
    assert prefill.transfer_bytes == decode.transfer_bytes >= sent > 0
    moved = sum(1 for r in disagg_runs.values() if r.result.report and r.result.report.bytes)
    assert prefill.transfers_ok == decode.transfers_ok >= moved
    assert prefill.transfers_failed == 0


def test_health_is_serving(procs: dict[str, WorkerProc]) -> None:
    for worker in procs.values():
        channel = grpc.insecure_channel(worker.address)
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "pdserve.v1.Worker"):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            channel.close()


def test_another_roles_calls_fail_with_failed_precondition(
    procs: dict[str, WorkerProc], cases: list[Case]
) -> None:
    prompt = cases[0].prompt
    reserve = worker_pb2.ReserveKVRequest(request_id="wrong-role", prompt_token_ids=prompt)
    with pytest.raises(grpc.RpcError) as err:
        procs["prefill"].stub.ReserveKV(reserve, timeout=10)
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "decode workers" in (err.value.details() or "")
    request = worker_pb2.PrefillRequest(request_id="wrong-role", prompt_token_ids=prompt)
    with pytest.raises(grpc.RpcError) as err:
        list(procs["decode"].stub.Prefill(request, timeout=10))
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION


# Repeats itself, so prompt lookup finds candidates that greedy decoding accepts.
REPEATING_PROMPT = "red green blue, red green blue, red green blue, red green"
SPECULATIVE_DEPTH = 4


@pytest.fixture(scope="module")
def speculating_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProc]]:
    """A prefill worker and a decode worker that speculates (ngram), apart from ``procs``
    so their transfers and stats stay their own."""
    tmp: Path = tmp_path_factory.mktemp("workers_disagg_speculative")
    speculative = ("--speculative", "ngram", "--num-speculative-tokens", str(SPECULATIVE_DEPTH))
    launched = [
        launch_worker("prefill-for-speculation", "prefill", tmp, *WORKER_ARGS),
        launch_worker("decode-speculative", "decode", tmp, *WORKER_ARGS, *speculative),
    ]
    with running(launched) as workers:
        yield workers


def test_a_speculating_decode_worker_gives_the_same_greedy_tokens(
    speculating_pair: list[WorkerProc],
    cases: list[Case],
    offline: dict[str, list[int]],
    smollm2_tokenizer: Any,
) -> None:
    prefill, decode = speculating_pair
    repeating = smollm2_tokenizer.encode(REPEATING_PROMPT)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    (reference,) = offline_llm().generate([repeating], params)
    run = run_disaggregated(prefill, decode, "speculated", repeating, greedy(MAX_TOKENS))
    assert run.token_ids == reference.token_ids
    stats = decode.stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_verify_steps > 0, stats
    counts = list(stats.spec_acceptance_length_counts)
    assert len(counts) == SPECULATIVE_DEPTH + 1 and sum(counts) == stats.spec_verify_steps
    assert sum(length * n for length, n in enumerate(counts)) == stats.spec_accepted_tokens
    code = cases[1]  # a prompt that does not repeat
    run = run_disaggregated(prefill, decode, "speculated-code", code.prompt, greedy(MAX_TOKENS))
    assert run.token_ids == offline[code.name]
    # A request that opts out never speculates, with the same tokens.
    before = decode.stats().spec_verify_steps
    opted_out = greedy(MAX_TOKENS, speculative=False)
    run = run_disaggregated(prefill, decode, "opted-out", repeating, opted_out)
    assert run.token_ids == reference.token_ids
    assert decode.stats().spec_verify_steps == before
    assert prefill.stats().spec_verify_steps == 0  # the prefill role never speculates
