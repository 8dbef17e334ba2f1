"""Request lifecycle against STUB workers: the disaggregated flow, back-pressure, retries,
cancellation, deadlines, limits and prefix-aware routing."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import httpx
import pytest

from pdserve.proto import common_pb2, inference_pb2, inference_pb2_grpc
from pdserve.proto.workers import WorkerLoad
from pdserve.router.config import RouterConfig
from pdserve.router.policies import CostModel
from pdserve.router.request.types import InMemoryTimingSink
from pdserve.router.state.link_rates import LinkRates
from pdserve.router.state.locality import InProcessLocalityIndex, engine_prompt_hasher
from tests.integration.stub_worker import FakeCharTokenizer, StubCluster, start_stub_cluster

S = grpc.StatusCode


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def generate(cluster: StubCluster, **fields) -> list[inference_pb2.GenerateTextResponse]:
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return list(stub.Generate(inference_pb2.GenerateTextRequest(**fields), timeout=10))


def methods(cluster: StubCluster, worker_id: str) -> list[str]:
    return [method for method, _ in cluster.workers[worker_id].record.calls]


def assert_no_load_left(cluster: StubCluster) -> None:
    tracker = cluster.lifecycle.tracker
    for worker_id in cluster.workers:

        def no_load(w: str = worker_id) -> bool:
            return tracker.effective_load(w, WorkerLoad()) == WorkerLoad()

        wait_for(no_load, f"{worker_id}'s local load to drop to zero")


@pytest.fixture()
def disagg() -> Iterator[StubCluster]:
    cluster = start_stub_cluster({"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"})
    yield cluster
    cluster.stop()


@pytest.fixture()
def colocated() -> Iterator[StubCluster]:
    cluster = start_stub_cluster({"w0": "colocated", "w1": "colocated"})
    yield cluster
    cluster.stop()


def test_disaggregated_flow_reserve_prefill_decode(disagg: StubCluster) -> None:
    responses = generate(disagg, text="hello", params=common_pb2.SamplingParams(max_tokens=3))
    assert "".join(r.chunk.text for r in responses) == " w0 w1 w2"
    last = responses[-1]
    assert (last.prefill_worker, last.decode_worker) == ("p0", "d0")  # ties go by worker id
    assert methods(disagg, "d0") == ["ReserveKV", "Decode"]
    assert methods(disagg, "p0") == ["Prefill"]
    assert last.timing.transfer_s == pytest.approx(0.002)  # the stub's TransferReport
    assert disagg.workers["d0"].reservations == set()
    assert_no_load_left(disagg)


def test_a_transfer_report_measures_its_link_and_the_next_request_avoids_a_slow_one(
    disagg: StubCluster,
) -> None:
    # The stub moves 100 bytes per prompt token in 2 ms: 50 kB/s per token, far below the
    # cost model's default for a link not measured yet.
    disagg.lifecycle.link_rates = LinkRates(min_bytes=1)
    first = generate(disagg, text="hello", params=common_pb2.SamplingParams(max_tokens=2))[-1]
    assert (first.prefill_worker, first.decode_worker) == ("p0", "d0")
    tokens = first.usage.prompt_tokens
    rates = disagg.lifecycle.link_rates.rates(time.monotonic())
    assert rates == {("p0", "d0"): pytest.approx(100 * tokens / 0.002)}
    second = generate(disagg, text="hello", params=common_pb2.SamplingParams(max_tokens=2))[-1]
    assert (second.prefill_worker, second.decode_worker) == ("p0", "d1")


def test_a_router_blind_to_links_measures_them_but_routes_as_if_every_link_were_alike() -> None:
    blind = start_stub_cluster({"p0": "prefill", "d0": "decode", "d1": "decode"},
                               RouterConfig(link_aware=False))  # fmt: skip
    try:
        blind.lifecycle.link_rates = LinkRates(min_bytes=1)
        params = common_pb2.SamplingParams(max_tokens=2)
        for _ in range(2):  # the same slow link measured, and chosen again (ties by id)
            last = generate(blind, text="hello", params=params)[-1]
            assert (last.prefill_worker, last.decode_worker) == ("p0", "d0")
        assert set(blind.lifecycle.link_rates.rates(time.monotonic())) == {("p0", "d0")}
    finally:
        blind.stop()


def test_finished_at_first_token_frees_the_decode_reservation(disagg: StubCluster) -> None:
    responses = generate(disagg, text="hello", params=common_pb2.SamplingParams(max_tokens=1))
    assert [r.chunk.text for r in responses] == [" w0"]
    assert responses[-1].chunk.finish_reason == "length"
    assert methods(disagg, "d0") == ["ReserveKV"]  # no Decode
    wait_for(lambda: disagg.workers["d0"].record.cancels == [responses[0].request_id], "Cancel")
    assert disagg.workers["d0"].reservations == set()


def test_refused_reservation_moves_to_the_next_decode_worker(disagg: StubCluster) -> None:
    disagg.workers["d0"].knobs.refuse_reserve = True
    last = generate(disagg, text="hello", params=common_pb2.SamplingParams(max_tokens=2))[-1]
    assert last.decode_worker == "d1"
    assert methods(disagg, "d0") == ["ReserveKV"]
    assert methods(disagg, "d1") == ["ReserveKV", "Decode"]
    disagg.workers["d1"].knobs.refuse_reserve = True
    with pytest.raises(grpc.RpcError) as caught:
        generate(disagg, text="hello")
    assert caught.value.code() is S.RESOURCE_EXHAUSTED
    assert "no decode worker has room" in caught.value.details()
    assert_no_load_left(disagg)


def test_retry_on_another_worker_when_one_fails_before_the_first_token(
    colocated: StubCluster,
) -> None:
    colocated.workers["w0"].knobs.fail_before_first_token = 1
    last = generate(colocated, text="hi", params=common_pb2.SamplingParams(max_tokens=2))[-1]
    assert last.prefill_worker == "w1"
    assert last.chunk.finish_reason == "length"
    (failed_id,) = [rid for _, rid in colocated.workers["w0"].record.calls]
    (retry_id,) = [rid for _, rid in colocated.workers["w1"].record.calls]
    assert retry_id == f"{failed_id}#1"  # a fresh id: a late Cancel cannot hit the retry
    assert_no_load_left(colocated)


def test_all_workers_failing_is_unavailable(colocated: StubCluster) -> None:
    for servicer in colocated.workers.values():
        servicer.knobs.fail_before_first_token = 1
    with pytest.raises(grpc.RpcError) as caught:
        generate(colocated, text="hi")
    assert caught.value.code() is S.UNAVAILABLE
    assert "w0" in caught.value.details() and "w1" in caught.value.details()


def test_prefill_failure_retries_and_cancels_the_reservation(disagg: StubCluster) -> None:
    disagg.workers["p0"].knobs.fail_before_first_token = 1
    last = generate(disagg, text="hello", params=common_pb2.SamplingParams(max_tokens=2))[-1]
    assert last.prefill_worker == "p1"
    first_id = disagg.workers["p0"].record.calls[0][1]
    wait_for(lambda: first_id in disagg.workers["d0"].record.cancels, "Cancel of the reservation")
    assert_no_load_left(disagg)


def test_grpc_client_cancel_reaches_the_worker(colocated: StubCluster) -> None:
    worker = colocated.workers["w0"]
    worker.knobs.hang_after_first_token = True
    with grpc.insecure_channel(colocated.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(inference_pb2.GenerateTextRequest(text="hi"), timeout=10)
        first = next(call)
        assert first.chunk.text == " w0"
        call.cancel()
    wait_for(lambda: len(worker.record.cancels) == 1, "Cancel at the worker")
    wait_for(lambda: len(worker.record.streams_cancelled) == 1, "the worker stream to close")
    assert worker.record.cancels == [worker.record.calls[0][1]]
    assert_no_load_left(colocated)


def test_http_disconnect_reaches_the_worker(colocated: StubCluster) -> None:
    worker = colocated.workers["w0"]
    worker.knobs.hang_after_first_token = True
    url = f"{colocated.http_url}/v1/completions"
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", url, json=body) as response:
        assert next(response.iter_lines()).startswith("data: ")
    wait_for(lambda: len(worker.record.cancels) == 1, "Cancel after a streaming disconnect")
    # Non-streaming: the client gives up (read timeout) and closes the connection.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json={**body, "stream": False}, timeout=0.5)
    wait_for(lambda: len(worker.record.cancels) == 2, "Cancel after a plain disconnect")
    assert_no_load_left(colocated)


def test_deadline_exceeded_cancels_the_worker(colocated: StubCluster) -> None:
    worker = colocated.workers["w0"]
    worker.knobs.hang_before_first_token = True
    with pytest.raises(grpc.RpcError) as caught:
        generate(colocated, text="hi", deadline_s=0.3)
    assert caught.value.code() is S.DEADLINE_EXCEEDED
    wait_for(lambda: len(worker.record.cancels) == 1, "Cancel after the deadline")
    assert_no_load_left(colocated)


def test_concurrency_limit_is_429_with_retry_after() -> None:
    config = RouterConfig(max_concurrent_requests=1, retry_after_s=7)
    cluster = start_stub_cluster({"w0": "colocated"}, config)
    try:
        cluster.workers["w0"].knobs.hang_after_first_token = True
        url = f"{cluster.http_url}/v1/completions"
        body = {"model": "fake-model", "prompt": "hi", "stream": True}
        with httpx.stream("POST", url, json=body) as held:
            lines = held.iter_lines()  # keep it: closing the iterator closes the response
            assert next(lines).startswith("data: ")
            refused = httpx.post(url, json=body)
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "7"
            assert refused.json()["error"]["type"] == "rate_limit_error"
            with pytest.raises(grpc.RpcError) as caught:
                generate(cluster, text="hi")
            assert caught.value.code() is S.RESOURCE_EXHAUSTED
        cluster.workers["w0"].knobs.hang_after_first_token = False
        wait_for(lambda: cluster.lifecycle.limiter.active == 0, "the held request to end")
        assert generate(cluster, text="hi")[-1].chunk.finish_reason == "length"
    finally:
        cluster.stop()


def test_a_request_that_would_queue_far_past_its_ttft_is_shed_with_429() -> None:
    """Prefill costs 0.5 s a token here. A long prompt alone is served (its own prefill is not
    queueing); with 10 prompt tokens queued on the only worker (this router's own count of
    what it sent there), the next request would wait 5 s, past 3 x the 1 s TTFT objective:
    refused before any worker is called, with a retry hint of the excess."""
    slow = CostModel(prefill_s_per_token=0.5)
    for factor, refused in ((3.0, True), (0.0, False)):
        config = RouterConfig(cost=slow, shed_ttft_factor=factor, adaptive_concurrency=False)
        cluster = start_stub_cluster({"w0": "colocated"}, config)
        try:
            assert generate(cluster, text="x" * 30)[-1].chunk.finish_reason == "length"
            cluster.lifecycle.tracker.start_prefill("w0", prompt_tokens=10)
            url = f"{cluster.http_url}/v1/completions"
            answer = httpx.post(url, json={"model": "fake-model", "prompt": "hi"})
            if not refused:
                assert answer.status_code == 200, answer.text
                continue
            assert answer.status_code == 429 and int(answer.headers["retry-after"]) >= 2
            assert "5.0 s of work queued, past the 3.0 s" in answer.json()["error"]["message"]
            with pytest.raises(grpc.RpcError) as caught:
                generate(cluster, text="hi")
            assert caught.value.code() is S.RESOURCE_EXHAUSTED
            assert len(methods(cluster, "w0")) == 1, "refused before any worker was called"
        finally:
            cluster.stop()


def test_prefix_aware_routing_follows_the_locality_index() -> None:
    index = InProcessLocalityIndex()
    hasher = engine_prompt_hasher("fake-model", block_size=16)
    cluster = start_stub_cluster(
        {"w0": "colocated", "w1": "colocated"}, locality=index, hasher=hasher
    )
    try:
        prompt = [1, *range(100, 140)]  # 41 tokens: two full blocks
        index.stored("w1", hasher(prompt))
        for policy in ("prefix_aware", "joint_ttft"):
            last = generate(
                cluster, token_ids=inference_pb2.TokenIds(ids=prompt), routing_policy=policy
            )[-1]
            assert last.prefill_worker == "w1"
            assert last.usage.cached_prompt_tokens == 32
        other = generate(cluster, token_ids=inference_pb2.TokenIds(ids=[1, *range(200, 240)]))
        assert other[-1].usage.cached_prompt_tokens == 0
    finally:
        cluster.stop()


def test_an_idle_worker_is_sent_to_fetch_the_prefix_of_a_busy_holder() -> None:
    """The joint policy's peer fetch reaches the prefill worker as ``peer_prefix``: the
    holder (its id and address) and the blocks to pull."""
    index = InProcessLocalityIndex()
    hasher = engine_prompt_hasher("fake-model", block_size=16)
    config = RouterConfig(cost=CostModel(step_tokens=16))  # p0 pins between short steps
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
    cluster = start_stub_cluster(roles, config, locality=index, hasher=hasher)
    try:
        prompt = [1, *range(100, 340)]  # 241 tokens: 15 full blocks
        index.stored("p0", hasher(prompt))
        idle = generate(cluster, token_ids=inference_pb2.TokenIds(ids=prompt))[-1]
        assert idle.prefill_worker == "p0" and not cluster.workers["p0"].record.peer_prefixes
        # With 2,000 prompt tokens queued on p0, p1 fetches the prefix from it instead.
        cluster.lifecycle.tracker.start_prefill("p0", 2000)
        busy = generate(cluster, token_ids=inference_pb2.TokenIds(ids=[*prompt[:-1], 7]))[-1]
        assert busy.prefill_worker == "p1"
        [(request_id, peer)] = cluster.workers["p1"].record.peer_prefixes.items()
        addresses = {w.worker_id: w.address for w in cluster.lifecycle.directory.live_workers()}
        assert (peer.worker_id, peer.address, peer.num_blocks) == ("p0", addresses["p0"], 15)
        assert request_id == cluster.workers["p1"].record.calls[0][1]
    finally:
        cluster.stop()


def test_prefix_aware_follows_its_own_placements_before_the_index_knows() -> None:
    # The index never learns anything here: the router's memory of where it sent each
    # prompt keeps a prefix on one worker, and spreads new prefixes over both.
    hasher = engine_prompt_hasher("fake-model", block_size=16)
    cluster = start_stub_cluster(
        {"w0": "colocated", "w1": "colocated"},
        locality=InProcessLocalityIndex(),
        hasher=hasher,
        config=RouterConfig(default_policy="prefix_aware"),
    )
    try:
        docs = [[1, *range(base, base + 48)] for base in (100, 200, 300, 400)]

        def served_by(doc: list[int], question: int) -> str:
            ids = inference_pb2.TokenIds(ids=[*doc, question, question + 1])
            return generate(cluster, token_ids=ids)[-1].prefill_worker

        first = [served_by(doc, 7) for doc in docs]
        assert sorted(first) == ["w0", "w0", "w1", "w1"], first
        again = [served_by(doc, 9) for doc in docs]
        assert again == first
    finally:
        cluster.stop()


def test_n_sequences_on_the_disaggregated_path(disagg: StubCluster) -> None:
    params = common_pb2.SamplingParams(max_tokens=2, n=2, seed=5)
    responses = generate(disagg, text="hi", params=params)
    by_index: dict[int, str] = {}
    for r in responses:
        by_index[r.chunk.index] = by_index.get(r.chunk.index, "") + r.chunk.text
    assert by_index == {0: " w0 w1", 1: " w0 w1"}
    assert responses[-1].usage.completion_tokens == 4
    prefill_params = disagg.workers["p0"].record.params
    assert sorted(p.seed for p in prefill_params) == [5, 6]  # distinct seeds per sequence
    assert all(p.n == 1 for p in prefill_params)
    assert_no_load_left(disagg)


def test_timings_are_recorded(colocated: StubCluster) -> None:
    responses = generate(colocated, text="hi", params=common_pb2.SamplingParams(max_tokens=4))
    sink = colocated.lifecycle.timing_sink
    assert isinstance(sink, InMemoryTimingSink)
    recorded = dict(sink.recent())
    timing = recorded[responses[0].request_id]
    assert len(timing.itl_s) == 3  # gaps between 4 chunks
    assert timing.e2e_s >= timing.ttft_s >= timing.queue_s >= 0


# -- a stream that breaks after the first token continues on another worker --------------

# Scripted stubs: token at absolute position p is the character SCRIPT[p]; the prompt "hi"
# is 3 tokens (BOS, "h", "i"), so the output starts at SCRIPT[3].
SCRIPT = "###one two ENDthree four five six seven eight nine ten"
PROMPT_TOKENS = FakeCharTokenizer().encode("hi")


def expected_output(max_tokens: int, stop: str | None = None) -> tuple[list[int], str]:
    """Token ids and text of an uninterrupted greedy run, from the script alone."""
    output = SCRIPT[len(PROMPT_TOKENS) : len(PROMPT_TOKENS) + max_tokens]
    if stop is not None and stop in output:
        output = output[: output.index(stop) + len(stop)]
        return [ord(c) for c in output], output[: -len(stop)]
    return [ord(c) for c in output], output


def scripted(roles: dict[str, str]) -> StubCluster:
    cluster = start_stub_cluster(roles)
    for worker in cluster.workers.values():
        worker.knobs.script = SCRIPT
    return cluster


@pytest.fixture()
def scripted_disagg() -> Iterator[StubCluster]:
    cluster = scripted({"p0": "prefill", "d0": "decode", "d1": "decode", "d2": "decode"})
    yield cluster
    cluster.stop()


@dataclass
class ClientStream:
    token_ids: list[int]
    text: str
    responses: list[inference_pb2.GenerateTextResponse]
    error: grpc.RpcError | None


def stream(cluster: StubCluster, params: common_pb2.SamplingParams) -> ClientStream:
    """Everything the client got, and the error that ended the stream (if any)."""
    responses, error = [], None
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(
            inference_pb2.GenerateTextRequest(text="hi", params=params), timeout=10
        )
        try:
            responses.extend(call)
        except grpc.RpcError as err:
            error = err
    ids = [t for r in responses for t in r.chunk.token_ids]
    return ClientStream(ids, "".join(r.chunk.text for r in responses), responses, error)


def replays(cluster: StubCluster, worker_id: str, method: str) -> list[tuple[str, tuple[int, ...]]]:
    """(request id, prompt) of each ``method`` call the worker got."""
    prompts = cluster.workers[worker_id].record.prompts
    return [(rid, prompt) for m, rid, prompt in prompts if m == method]


def test_decode_worker_killed_mid_stream_the_request_continues_on_another(
    scripted_disagg: StubCluster,
) -> None:
    cluster = scripted_disagg
    cluster.workers["d0"].knobs.die_after_tokens = 3  # its server stops: UNAVAILABLE
    got = stream(cluster, common_pb2.SamplingParams(max_tokens=14))
    assert got.error is None
    expected_ids, expected_text = expected_output(14)
    assert got.token_ids == expected_ids  # none lost, none twice
    assert got.text == expected_text
    last = got.responses[-1]
    assert (last.chunk.finish_reason, last.decode_worker) == ("length", "d1")
    assert last.usage.completion_tokens == 14
    # The replay: prompt + the tokens the client had (1 from prefill + up to 3 from d0).
    ((rid, prompt),) = replays(cluster, "d1", "Decode")
    assert rid == f"{last.request_id}+f1"
    sent = len(prompt) - len(PROMPT_TOKENS)
    assert 1 <= sent <= 4 and prompt == (*PROMPT_TOKENS, *expected_ids[:sent])
    (decode_params,) = [p for p in cluster.workers["d1"].record.params]
    assert decode_params.max_tokens == 14 - sent
    # The dead worker is skipped from now on; the cluster keeps serving.
    again = stream(cluster, common_pb2.SamplingParams(max_tokens=5))
    assert (again.error, again.token_ids) == (None, expected_output(5)[0])
    assert_no_load_left(cluster)


def test_stop_string_across_the_break_gives_the_uninterrupted_text(
    scripted_disagg: StubCluster,
) -> None:
    cluster = scripted_disagg
    params = common_pb2.SamplingParams(max_tokens=20, stop=["END"])
    uninterrupted = stream(cluster, params)
    expected_ids, expected_text = expected_output(20, stop="END")
    assert (uninterrupted.token_ids, uninterrupted.text) == (expected_ids, expected_text)
    # Output "one two ENDthree": the first token "o" comes from the prefill worker, then the
    # decode worker sends 8 more, up to "E", which it holds back (it may start "END"), and
    # its stream ends without a finish. The held-back "E" must not be lost.
    for worker_id in ("d0", "d1", "d2"):
        cluster.workers[worker_id].knobs.die_after_tokens = 8
        cluster.workers[worker_id].knobs.die_by_ending_stream = True
    got = stream(cluster, params)
    assert got.error is None
    assert (got.token_ids, got.text) == (expected_ids, expected_text)
    assert got.responses[-1].chunk.finish_reason == "stop"
    # The router found the stop itself: the replay went out without stop strings, and its
    # decode worker was told to stop (Cancel).
    ((worker_id, rid),) = [
        (worker_id, rid)
        for worker_id in ("d0", "d1", "d2")
        for rid, _ in replays(cluster, worker_id, "Decode")
        if rid.endswith("+f1")
    ]
    replay_params = cluster.workers[worker_id].record.params[-1]
    assert list(replay_params.stop) == [] and replay_params.max_tokens == 20 - 9
    wait_for(lambda: rid in cluster.workers[worker_id].record.cancels, "Cancel of the replay")


def test_failover_is_bounded_then_unavailable_and_the_cluster_keeps_serving(
    scripted_disagg: StubCluster,
) -> None:
    cluster = scripted_disagg
    for worker_id in ("d0", "d1", "d2"):  # each stream ends early, once
        cluster.workers[worker_id].knobs.die_after_tokens = 2
        cluster.workers[worker_id].knobs.die_by_ending_stream = True
    got = stream(cluster, common_pb2.SamplingParams(max_tokens=20))
    assert got.error is not None and got.error.code() is S.UNAVAILABLE
    details = got.error.details()
    assert "gave up after 2 failover(s)" in details
    assert all(f"worker {w} ({'STREAM_ENDED'}" in details for w in ("d0", "d1", "d2"))
    # What the client got before the error has no gap and no repeat: 3 streams x (1 + 2).
    expected_ids, _ = expected_output(20)
    assert got.token_ids == expected_ids[:9]
    after = stream(cluster, common_pb2.SamplingParams(max_tokens=6))
    assert (after.error, after.token_ids) == (None, expected_output(6)[0])
    assert_no_load_left(cluster)


def test_colocated_worker_killed_mid_stream_continues_on_another() -> None:
    cluster = scripted({"w0": "colocated", "w1": "colocated"})
    try:
        cluster.workers["w0"].knobs.die_after_tokens = 4
        got = stream(cluster, common_pb2.SamplingParams(max_tokens=12))
        assert got.error is None
        assert (got.token_ids, got.text) == expected_output(12)
        assert got.responses[-1].prefill_worker == "w1"
        ((rid, prompt),) = replays(cluster, "w1", "Generate")
        assert rid.endswith("+f1") and prompt[: len(PROMPT_TOKENS)] == tuple(PROMPT_TOKENS)
    finally:
        cluster.stop()


def test_without_a_router_tokenizer_only_clean_breaks_fail_over(
    scripted_disagg: StubCluster,
) -> None:
    cluster = scripted_disagg
    cluster.lifecycle.text_decoder = None
    cluster.workers["d0"].knobs.die_after_tokens = 3
    cluster.workers["d0"].knobs.die_by_ending_stream = True
    clean = stream(cluster, common_pb2.SamplingParams(max_tokens=10))
    assert clean.error is None and (clean.token_ids, clean.text) == expected_output(10)
    # With stop strings the dead worker may have held text back: the router cannot know.
    for worker_id in ("d0", "d1", "d2"):
        cluster.workers[worker_id].knobs.die_after_tokens = 3
    held = stream(cluster, common_pb2.SamplingParams(max_tokens=10, stop=["zzz"]))
    assert held.error is not None and held.error.code() is S.UNAVAILABLE
    assert "no tokenizer" in held.error.details()


def test_one_of_n_sequences_fails_over_alone(scripted_disagg: StubCluster) -> None:
    cluster = scripted_disagg
    cluster.workers["d0"].knobs.die_after_tokens = 3  # n=2 is two requests; one hits d0
    cluster.workers["d0"].knobs.die_by_ending_stream = True
    got = stream(cluster, common_pb2.SamplingParams(max_tokens=10, n=2))
    assert got.error is None
    by_index: dict[int, list[int]] = {0: [], 1: []}
    for r in got.responses:
        by_index[r.chunk.index] += r.chunk.token_ids
    expected_ids, _ = expected_output(10)
    assert by_index == {0: expected_ids, 1: expected_ids}
    assert got.responses[-1].usage.completion_tokens == 20
    replayed = [rid for w in ("d1", "d2") for rid, _ in replays(cluster, w, "Decode")]
    assert [rid for rid in replayed if "+f" in rid] in (
        [f"{got.responses[0].request_id}.0+f1"],
        [f"{got.responses[0].request_id}.1+f1"],
    )
