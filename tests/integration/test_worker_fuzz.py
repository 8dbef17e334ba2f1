"""Hostile input at the worker gRPC API: malformed, truncated, oversized, replayed and
out-of-order calls to a real prefill and decode worker pair (NIXL between them), served from
this process so that their KV pools can be checksummed.

Every call must be refused with a clear status (INVALID_ARGUMENT naming the message or the
field, FAILED_PRECONDITION for a call that does not fit the worker's state, never UNKNOWN or
INTERNAL), leave no block held, change no pool block, and the workers must serve on: the
last test checks the same greedy tokens as before the fuzz.

Not sent: a destination that names blocks inside the decode worker's pool without a live
reservation. A NIXL sender writes into the receiver's registered memory before the receiver
sees the transfer's header (docs/benchmarks.md, "Worker and KV wire fuzzing").

Hypothesis runs derandomized. The last test checks the totals, so run the whole file.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.prefill_worker.prefill import PrefillService
from pdserve.proto import common_pb2, worker_pb2
from pdserve.worker.host import WorkerSpec
from pdserve.worker.server import MAX_MESSAGE_BYTES
from tests.integration.fuzzing import Tally, fuzz
from tests.integration.grpc_fuzz import bad_sampling_params, call_bytes, malformed_bytes, parses
from tests.integration.worker_hosts import InProcessWorker, hosted_workers
from tests.integration.worker_procs import greedy, wait_for

pytestmark = pytest.mark.slow

NUM_BLOCKS = 16
VOCAB = 49152  # SmolLM2's
CONTEXT = 8192
# Bounds: a reservation's blocks are freed once its transfer has ended (at the receiver's
# timeout when nothing arrives); the one real transfer must land within it on a busy machine.
TRANSFER_TIMEOUT_S = 8.0
FREED_WITHIN_S = 30.0
MIN_CASES = 600
S = grpc.StatusCode
NEVER = (S.UNKNOWN, S.INTERNAL)
_FLAGS = (
    *("--num-blocks", str(NUM_BLOCKS), "--metrics-port", "-1"),
    *("--transfer-timeout-s", str(TRANSFER_TIMEOUT_S), "--reservation-timeout-s", "600"),
)
_SHORT_PROMPT = [1, 2, 3]


@dataclass
class Pair:
    prefill: InProcessWorker
    decode: InProcessWorker

    @property
    def workers(self) -> tuple[InProcessWorker, InProcessWorker]:
        return self.prefill, self.decode


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    specs = [
        WorkerSpec("prefill", "fuzz-prefill", extra_args=_FLAGS),
        WorkerSpec("decode", "fuzz-decode", extra_args=_FLAGS),
    ]
    with hosted_workers(specs) as (prefill, decode):
        yield Pair(prefill, decode)


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer: Any) -> list[int]:
    ids: list[int] = smollm2_tokenizer.encode("The tide tables of a small harbour. " * 3)
    assert 16 < len(ids) <= 48, "the prompt spans a few blocks"
    return ids


@pytest.fixture(scope="module")
def tally() -> Tally:
    return Tally()


@pytest.fixture(scope="module")
def reference(pair: Pair, prompt: list[int]) -> list[int]:
    """The greedy tokens of a valid disaggregated request, before any fuzzing."""
    return _disaggregated(pair, "reference", prompt)


def _all_free(worker: InProcessWorker) -> bool:
    stats = worker.stats()
    return stats.free_blocks == stats.total_blocks == NUM_BLOCKS and stats.running == 0


def _reserve(decode: InProcessWorker, request_id: str, prompt: list[int]) -> Any:
    request = worker_pb2.ReserveKVRequest(request_id=request_id, prompt_token_ids=prompt)
    reply = decode.stub.ReserveKV(request, timeout=30)
    assert reply.accepted
    return reply.destination


def _decode_request(
    request_id: str, prompt: list[int], first: Any, transfer_timeout_s: float = 30.0
) -> Any:
    return worker_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=greedy(8),
        first_token=first,
        transfer_timeout_s=transfer_timeout_s,
    )


def _disaggregated(pair: Pair, request_id: str, prompt: list[int]) -> list[int]:
    destination = _reserve(pair.decode, request_id, prompt)
    request = worker_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, params=greedy(8), destination=destination
    )
    events = list(pair.prefill.stub.Prefill(request, timeout=60))
    assert events[1].transfer.ok, events[1].transfer.error
    first = events[0].first_token
    chunks = pair.decode.stub.Decode(_decode_request(request_id, prompt, first), timeout=60)
    return [*first.token_ids, *(t for c in chunks for t in c.token_ids)]


# --- one hostile call, and what must hold around it ----------------------------------------

_STREAMING = {"Generate", "Prefill", "Decode"}
_REPLY: dict[str, type[Message]] = {
    "Generate": common_pb2.TokenChunk,
    "Prefill": worker_pb2.PrefillEvent,
    "ReserveKV": worker_pb2.ReserveKVResponse,
    "Decode": common_pb2.TokenChunk,
    "Cancel": worker_pb2.CancelResponse,
    "GetStats": worker_pb2.WorkerStats,
}
_ROLE = {"Prefill": "prefill", "ReserveKV": "decode", "Decode": "decode"}


def _call(pair: Pair, rpc: str, raw: bytes) -> tuple[grpc.StatusCode, str, list[Message]]:
    worker = pair.decode if _ROLE.get(rpc) == "decode" else pair.prefill
    method = f"/pdserve.v1.Worker/{rpc}"
    return call_bytes(worker.channel, method, raw, rpc in _STREAMING, _REPLY[rpc], 60.0)


def _hostile(pair: Pair, tally: Tally, family: str, rpc: str, raw: bytes) -> tuple[Any, str]:
    """Call ``rpc`` with ``raw`` on the idle pair: refused with a status (not UNKNOWN or
    INTERNAL) and a reason, no pool block changed, nothing held afterwards."""
    before = [w.block_checksums() for w in pair.workers]
    code, details, _ = _call(pair, rpc, raw)
    assert code not in NEVER, f"{family}: {code.name} {details}"
    assert code is not S.OK, f"{family}: served"
    assert details, f"{family}: {code.name} without a reason"
    for worker in pair.workers:
        assert wait_for(lambda w=worker: _all_free(w), FREED_WITHIN_S), f"{family}: blocks held"
    assert [w.block_checksums() for w in pair.workers] == before, f"{family}: a block changed"
    tally.add(family, code.name)
    return code, details


def _cancel_if_reserved(pair: Pair, rpc: str, raw: bytes, code: grpc.StatusCode) -> None:
    if rpc == "ReserveKV" and code is S.OK:
        request_id = worker_pb2.ReserveKVRequest.FromString(raw).request_id
        pair.decode.stub.Cancel(worker_pb2.CancelRequest(request_id=request_id), timeout=30)


# --- malformed protobuf -------------------------------------------------------------------

_DESTINATION = worker_pb2.KVDestination(
    worker_id="d", backend="nixl", agent_metadata=b"m" * 8, block_ids=[1], transfer_id="t"
)
VALID: dict[str, Message] = {
    "Generate": worker_pb2.GenerateRequest(
        request_id="fz-g", prompt_token_ids=_SHORT_PROMPT, params=greedy(1)
    ),
    "Prefill": worker_pb2.PrefillRequest(
        request_id="fz-p", prompt_token_ids=_SHORT_PROMPT, params=greedy(1),
        destination=_DESTINATION,
    ),
    "ReserveKV": worker_pb2.ReserveKVRequest(request_id="fz-r", prompt_token_ids=_SHORT_PROMPT),
    "Decode": worker_pb2.DecodeRequest(
        request_id="fz-d", prompt_token_ids=_SHORT_PROMPT, params=greedy(1),
        first_token=common_pb2.TokenChunk(token_ids=[5]), transfer_timeout_s=0.1,
    ),
    "Cancel": worker_pb2.CancelRequest(request_id="fz-c"),
    "GetStats": worker_pb2.StatsRequest(),
}  # fmt: skip


@fuzz(300)
@given(data=st.data(), rpc=st.sampled_from(sorted(VALID)))
def test_malformed_protobuf_is_invalid_argument_naming_the_message(
    pair: Pair, tally: Tally, data: st.DataObject, rpc: str
) -> None:
    family, raw = data.draw(malformed_bytes(VALID[rpc]))
    request_type = type(VALID[rpc])
    if not parses(request_type, raw):
        _, details = _hostile(pair, tally, f"malformed {family}", rpc, raw)
        assert request_type.DESCRIPTOR.full_name in details, details
        return
    # Well-formed after all (cut at a field boundary, a known field with the wrong wire
    # type kept as an unknown field): served, or refused for its values.
    code, details, _ = _call(pair, rpc, raw)
    assert code in (S.OK, S.INVALID_ARGUMENT, S.FAILED_PRECONDITION, S.UNAVAILABLE), details
    _cancel_if_reserved(pair, rpc, raw, code)
    for worker in pair.workers:
        assert wait_for(lambda w=worker: _all_free(w), FREED_WITHIN_S), f"{rpc}: blocks held"
    tally.add(f"malformed {family}, parses", code.name)


# --- well-formed requests with one bad value -----------------------------------------------

_BAD_REQUEST_IDS = st.sampled_from(["", "x" * 201, "a\x00b", "tab\there", "new\nline"])
_BAD_PROMPTS = st.one_of(
    st.just([]),
    st.lists(st.integers(VOCAB, 2**32 - 1), min_size=1, max_size=4),
    st.integers(CONTEXT, 4 * CONTEXT).map(lambda n: [7] * n),
)


def _field_of(prompt: list[int]) -> str:
    return "prompt_token_ids" if not prompt else "prompt"


@fuzz(40)
@given(rpc=st.sampled_from(["Generate", "Prefill", "ReserveKV", "Decode"]), rid=_BAD_REQUEST_IDS)
def test_bad_request_ids_are_invalid_argument(pair: Pair, tally: Tally, rpc: str, rid: str) -> None:
    message = type(VALID[rpc])()
    message.CopyFrom(VALID[rpc])
    message.request_id = rid  # type: ignore[attr-defined]
    raw = message.SerializeToString()
    code, details = _hostile(pair, tally, "bad request_id", rpc, raw)
    assert code is S.INVALID_ARGUMENT and "request_id" in details, details


@fuzz(60)
@given(rpc=st.sampled_from(["Generate", "Prefill", "ReserveKV"]), bad=_BAD_PROMPTS)
def test_bad_prompts_are_invalid_argument(
    pair: Pair, tally: Tally, rpc: str, bad: list[int]
) -> None:
    """Empty, token ids outside the vocabulary, longer than the context (oversized)."""
    message = type(VALID[rpc])()
    message.CopyFrom(VALID[rpc])
    message.prompt_token_ids[:] = bad  # type: ignore[attr-defined]
    raw = message.SerializeToString()
    code, details = _hostile(pair, tally, "bad prompt", rpc, raw)
    assert code is S.INVALID_ARGUMENT and _field_of(bad) in details, details


@fuzz(80)
@given(rpc=st.sampled_from(["Generate", "Prefill", "Decode"]), case=bad_sampling_params(CONTEXT))
def test_bad_sampling_params_are_invalid_argument_naming_the_field(
    pair: Pair, tally: Tally, rpc: str, case: tuple[str, common_pb2.SamplingParams]
) -> None:
    name, params = case
    message = type(VALID[rpc])()
    message.CopyFrom(VALID[rpc])
    message.params.CopyFrom(params)  # type: ignore[attr-defined]
    raw = message.SerializeToString()
    code, details = _hostile(pair, tally, "bad params", rpc, raw)
    assert code is S.INVALID_ARGUMENT and name in details, f"{name}: {details}"


_BAD_FIRST_TOKENS = st.one_of(
    st.just(None),
    st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=3),
    st.integers(VOCAB, 2**32 - 1).map(lambda t: [t]),
    st.just([5, "stop"]),
)
_BAD_TIMEOUTS = st.floats(max_value=-1e-300) | st.just(math.nan) | st.just(math.inf)


@fuzz(50)
@given(first=_BAD_FIRST_TOKENS, timeout_s=st.none() | _BAD_TIMEOUTS)
def test_bad_decode_inputs_are_refused_before_any_reservation_is_looked_up(
    pair: Pair, tally: Tally, first: Any, timeout_s: float | None
) -> None:
    request = worker_pb2.DecodeRequest()
    request.CopyFrom(VALID["Decode"])
    if timeout_s is not None:
        request.transfer_timeout_s = timeout_s
    else:
        request.ClearField("first_token")
        if first is not None:
            finish = first[-1] == "stop"
            request.first_token.token_ids[:] = first[:1] if finish else first
            request.first_token.finish_reason = "stop" if finish else ""
    raw = request.SerializeToString()
    if raw == VALID["Decode"].SerializeToString():
        return
    code, details = _hostile(pair, tally, "bad decode input", "Decode", raw)
    field = "transfer_timeout_s" if timeout_s is not None else "first_token"
    assert code is S.INVALID_ARGUMENT and field in details, details


# --- destinations: malformed, oversized, outside the pool, for another backend -------------


def _destination_cases(real: worker_pb2.KVDestination) -> st.SearchStrategy[tuple[str, Any]]:
    """(family, destination) for the 3-block prompt, each bad in one way."""
    n = len(real.block_ids)

    def dest(**change: Any) -> worker_pb2.KVDestination:
        d = worker_pb2.KVDestination()
        d.CopyFrom(real)
        for key, value in change.items():
            if key == "block_ids":
                d.block_ids[:] = value
            else:
                setattr(d, key, value)
        return d

    out_of_pool = st.lists(st.integers(NUM_BLOCKS, 2**32 - 1), min_size=n, max_size=n)
    return st.one_of(
        st.integers(0, 40)
        .filter(lambda k: k != n)
        .map(lambda k: ("block count", dest(block_ids=list(range(k))))),
        st.just(("block count, oversized", dest(block_ids=list(range(2**20))))),
        out_of_pool.map(lambda ids: ("ids outside the pool", dest(block_ids=ids))),
        st.just(("duplicate ids", dest(block_ids=[real.block_ids[0]] * n))),
        st.integers(n + 1, 2**32 - 1).map(
            lambda p: ("num_present_blocks", dest(num_present_blocks=p))
        ),
        st.binary(max_size=64).map(lambda b: ("agent_metadata", dest(agent_metadata=b))),
        st.integers(1, len(real.agent_metadata) - 1).map(
            lambda k: ("agent_metadata cut", dest(agent_metadata=real.agent_metadata[:k]))
        ),
        st.sampled_from(["", "x" * 300, "é" * 200]).map(
            lambda t: ("transfer_id", dest(transfer_id=t))
        ),
        st.sampled_from(["tcp", "", "rdma"]).map(lambda b: ("backend", dest(backend=b))),
    )


@pytest.fixture()
def live_destination(pair: Pair, prompt: list[int]) -> Iterator[worker_pb2.KVDestination]:
    """A real reservation's answer that is never sent to: the bad copies of it must be
    refused before the prompt is computed. Cancelled after the test."""
    yield _reserve(pair.decode, "fz-live", prompt)
    pair.decode.stub.Cancel(worker_pb2.CancelRequest(request_id="fz-live"), timeout=30)
    assert wait_for(lambda: _all_free(pair.decode), FREED_WITHIN_S)


@settings(  # one reservation for all examples, which the fixture gives
    fuzz(120),
    suppress_health_check=[*fuzz(1).suppress_health_check, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_bad_destinations_are_refused_before_the_prefill(
    pair: Pair, tally: Tally, prompt: list[int], live_destination: Any, data: st.DataObject
) -> None:
    family, bad = data.draw(_destination_cases(live_destination))
    request = worker_pb2.PrefillRequest(
        request_id="fz-dest", prompt_token_ids=prompt, params=greedy(4), destination=bad
    )
    raw = request.SerializeToString()
    prefilled = pair.prefill.stats().prompt_tokens
    code, details = _hostile_beside(pair, tally, f"destination: {family}", raw)
    assert "destination" in details, details
    expected = S.FAILED_PRECONDITION if family == "backend" else S.INVALID_ARGUMENT
    assert code is expected, details
    assert pair.prefill.stats().prompt_tokens == prefilled, "refused after computing the prompt"


def _hostile_beside(pair: Pair, tally: Tally, family: str, raw: bytes) -> tuple[Any, str]:
    """``_hostile`` while the live reservation holds its blocks (counted as held)."""
    before = [w.block_checksums() for w in pair.workers]
    free = [w.stats().free_blocks for w in pair.workers]
    code, details, _ = _call(pair, "Prefill", raw)
    assert code not in NEVER and code is not S.OK and details, f"{family}: {code} {details}"
    assert [w.stats().free_blocks for w in pair.workers] == free, f"{family}: blocks held"
    assert [w.block_checksums() for w in pair.workers] == before, f"{family}: a block changed"
    tally.add(family, code.name)
    return code, details


def test_a_message_over_the_size_limit_is_resource_exhausted(pair: Pair, tally: Tally) -> None:
    request = worker_pb2.GenerateRequest(request_id="x" * MAX_MESSAGE_BYTES, prompt_token_ids=[7])
    raw = request.SerializeToString()
    code, _ = _hostile(pair, tally, "oversized message", "Generate", raw)
    assert code is S.RESOURCE_EXHAUSTED


# --- replayed and out-of-order calls -------------------------------------------------------


def test_replayed_and_out_of_order_calls_are_failed_precondition(
    pair: Pair, tally: Tally, prompt: list[int], reference: list[int]
) -> None:
    """Decode before ReserveKV, ReserveKV twice, Decode twice, Prefill again for a
    destination already sent to, Decode after the stream ended: each refused, the decode
    pool untouched by the replays."""
    first = common_pb2.TokenChunk(token_ids=[5])
    for round_ in range(3):
        rid = f"order-{round_}"
        decode_raw = _decode_request(rid, prompt, first).SerializeToString()
        code, details = _hostile(pair, tally, "Decode before ReserveKV", "Decode", decode_raw)
        assert code is S.FAILED_PRECONDITION and rid in details, details

        _reserve(pair.decode, rid, prompt)
        again = worker_pb2.ReserveKVRequest(request_id=rid, prompt_token_ids=prompt)
        code, details, _ = _call(pair, "ReserveKV", again.SerializeToString())
        assert code is S.INVALID_ARGUMENT and "already holds a KV reservation" in details
        tally.add("ReserveKV twice", code.name)
        short = _decode_request(rid, prompt, first, transfer_timeout_s=0.05)
        assert _call(pair, "Decode", short.SerializeToString())[0] is S.UNAVAILABLE
        code, details = _hostile(pair, tally, "Decode twice", "Decode", decode_raw)
        assert code is S.FAILED_PRECONDITION, details

        served = f"served-{round_}"
        destination = _reserve(pair.decode, served, prompt)
        prefill = worker_pb2.PrefillRequest(
            request_id=served, prompt_token_ids=prompt, params=greedy(8), destination=destination
        )
        events = list(pair.prefill.stub.Prefill(prefill, timeout=60))
        tokens = [*events[0].first_token.token_ids]
        chunks = pair.decode.stub.Decode(
            _decode_request(served, prompt, events[0].first_token), timeout=60
        )
        assert tokens + [t for c in chunks for t in c.token_ids] == reference
        replay = prefill.SerializeToString()
        code, details = _hostile(pair, tally, "Prefill replayed", "Prefill", replay)
        assert code is S.FAILED_PRECONDITION and "was sent to already" in details, details
        late = _decode_request(served, prompt, events[0].first_token).SerializeToString()
        code, details = _hostile(pair, tally, "Decode replayed", "Decode", late)
        assert code is S.FAILED_PRECONDITION, details


# --- out of order: the caller leaves before the worker resumes ----------------------------


async def _first_event_then_gone(
    prefill: PrefillService, request: worker_pb2.PrefillRequest
) -> worker_pb2.PrefillEvent:
    """Take the first event and close the stream at once, as gRPC does when the caller
    cancels before the handler resumes after its first message."""
    stream = prefill.prefill(request)
    first = await anext(stream)
    await stream.aclose()
    await asyncio.sleep(0)
    return first


def test_prefill_caller_gone_before_the_stream_resumes_still_delivers(
    pair: Pair, tally: Tally, prompt: list[int], reference: list[int]
) -> None:
    """Regression: the transfer started only when the stream resumed after its first event,
    so a caller leaving in between left the decode worker waiting for KV that never came."""
    destination = _reserve(pair.decode, "gone-at-once", prompt)
    request = worker_pb2.PrefillRequest(
        request_id="gone-at-once",
        prompt_token_ids=prompt,
        params=greedy(8),
        destination=destination,
    )
    service = pair.prefill.roles.prefill
    assert service is not None
    first = pair.prefill.run(_first_event_then_gone(service, request)).first_token
    chunks = pair.decode.stub.Decode(_decode_request("gone-at-once", prompt, first), timeout=60)
    assert [*first.token_ids, *(t for c in chunks for t in c.token_ids)] == reference
    for worker in pair.workers:
        assert wait_for(lambda w=worker: _all_free(w), FREED_WITHIN_S)
    tally.add("caller gone at the first token", "delivered")


# --- after all that: still serving ----------------------------------------------------------


def test_workers_serve_on_after_the_fuzz(
    pair: Pair, tally: Tally, prompt: list[int], reference: list[int]
) -> None:
    print(f"\nworker API fuzz: {tally.total()} calls\n{tally.report()}")
    assert tally.total() >= MIN_CASES, "run the whole file"
    for worker in pair.workers:
        assert wait_for(lambda w=worker: _all_free(w), FREED_WITHIN_S), "blocks held"
    assert _disaggregated(pair, "after-fuzz", prompt) == reference
    request = worker_pb2.GenerateRequest(
        request_id="after-fuzz-gen", prompt_token_ids=prompt, params=greedy(8)
    )
    chunks = pair.prefill.stub.Generate(request, timeout=60)
    assert [t for c in chunks for t in c.token_ids] == reference
