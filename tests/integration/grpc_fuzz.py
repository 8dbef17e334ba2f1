"""Hypothesis strategies for gRPC APIs: malformed protobuf bytes and bad values. The router's
Inference API is described here; the worker fuzz (test_worker_fuzz.py) uses the same
strategies over its own messages.

The wire format is written by hand here (tags, varints, length prefixes) so that bytes no
protobuf library would produce can be sent: truncated messages, huge or overlong length
prefixes, invalid UTF-8 in string fields, known fields with the wrong wire type, unknown
fields, deep groups. Which outcome a byte string deserves is decided by parsing it locally
with the same message class (see the fuzz test), not by this module.
"""

from __future__ import annotations

import math

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import strategies as st

from pdserve.proto import common_pb2, inference_pb2
from pdserve.router.edge.grpc_server import MAX_DEADLINE_S
from pdserve.router.policies import POLICY_NAMES

MODEL = "fake-model"
VARINT, FIXED64, LEN, START_GROUP, END_GROUP, FIXED32 = 0, 1, 2, 3, 4, 5
_MAX_FIELD_NUMBER = 2**29 - 1
_RESERVED_FIELD_NUMBERS = range(19000, 20000)  # protobuf's own; never valid on the wire

RPCS: dict[str, type[Message]] = {
    "Generate": inference_pb2.GenerateTextRequest,
    "Tokenize": inference_pb2.TokenizeRequest,
    "ListModels": inference_pb2.ListModelsRequest,
}
_HI_CHAT = inference_pb2.ChatMessages(
    messages=[inference_pb2.ChatMessage(role="user", content="hi")]
)
VALID_MESSAGES: dict[str, Message] = {
    "Generate": inference_pb2.GenerateTextRequest(
        model=MODEL,
        chat=_HI_CHAT,
        params=common_pb2.SamplingParams(max_tokens=1, temperature=0.0, stop=["zz"]),
        routing_policy="round_robin",
        deadline_s=30.0,
    ),
    "Tokenize": inference_pb2.TokenizeRequest(model=MODEL, chat=_HI_CHAT),
    "ListModels": inference_pb2.ListModelsRequest(),
}


REPLY_TYPES: dict[str, type[Message]] = {
    "Generate": inference_pb2.GenerateTextResponse,
    "Tokenize": inference_pb2.TokenizeResponse,
    "ListModels": inference_pb2.ListModelsResponse,
}


def call_raw(
    channel: grpc.Channel, rpc: str, raw: bytes
) -> tuple[grpc.StatusCode, str, list[Message]]:
    """An Inference RPC with ``raw`` as its request bytes; (code, details, parsed replies)."""
    method = f"/pdserve.v1.Inference/{rpc}"
    return call_bytes(channel, method, raw, rpc == "Generate", REPLY_TYPES[rpc])


def call_bytes(
    channel: grpc.Channel,
    method: str,
    raw: bytes,
    streaming: bool,
    reply_type: type[Message],
    timeout_s: float = 30.0,
) -> tuple[grpc.StatusCode, str, list[Message]]:
    """Send ``raw`` as the request bytes (no serializer); (code, details, parsed replies)."""
    try:
        if streaming:
            replies = list(channel.unary_stream(method)(raw, timeout=timeout_s))
        else:
            replies = [channel.unary_unary(method)(raw, timeout=timeout_s)]
    except grpc.RpcError as err:
        return err.code(), err.details() or "", []
    return grpc.StatusCode.OK, "", [reply_type.FromString(r) for r in replies]


def parses(cls: type[Message], raw: bytes) -> bool:
    try:
        cls.FromString(raw)
    except DecodeError:
        return False
    return True


def reply_content(replies: list[Message]) -> list[Message]:
    """``replies`` without what differs between two runs of one request (ids and timing)."""
    out = []
    for reply in replies:
        copy = type(reply).FromString(reply.SerializeToString())
        for name in ("request_id", "timing"):
            if name in copy.DESCRIPTOR.fields_by_name:
                copy.ClearField(name)
        out.append(copy)
    return out


def bad_generate_requests() -> st.SearchStrategy[tuple[str, inference_pb2.GenerateTextRequest]]:
    """Well-formed Generate requests with one value out of range: (field named, request)."""
    with_params = bad_sampling_params(254).map(  # "hi" leaves room for 253 tokens
        lambda np: (np[0], inference_pb2.GenerateTextRequest(text="hi", params=np[1]))
    )
    return with_params | _bad_request_fields()


def bad_sampling_params(
    max_tokens_over: int,
) -> st.SearchStrategy[tuple[str, common_pb2.SamplingParams]]:
    """Sampling parameters with one value out of range: (field named, params).
    ``max_tokens_over``: the smallest max_tokens the prompt it goes with has no room for."""
    nan = st.just(math.nan)
    negative = st.floats(max_value=-1e-30)  # stays negative in float32
    floats = {
        "temperature": negative | nan,
        "top_p": st.floats(max_value=0.0) | st.floats(min_value=1.001) | nan,
        "min_p": negative | st.floats(min_value=1.001) | nan,
        "repetition_penalty": st.floats(max_value=0.0) | st.just(math.inf) | nan,
        "presence_penalty": st.floats(min_value=2.001) | st.floats(max_value=-2.001) | nan,
        "frequency_penalty": st.floats(min_value=2.001) | st.floats(max_value=-2.001) | nan,
    }
    ints = {
        "max_tokens": st.just(0) | st.integers(max_tokens_over, 2**32 - 1),
        "logprobs": st.integers(21, 2**32 - 1),
        "n": st.just(0) | st.integers(17, 2**32 - 1),
    }
    params = [_with_param(name, values) for name, values in {**floats, **ints}.items()]
    params.append(
        st.lists(st.sampled_from(["", "x"]), min_size=1, max_size=4)
        .filter(lambda stop: "" in stop)
        .map(lambda stop: ("stop", common_pb2.SamplingParams(stop=stop)))
    )
    return st.one_of(params)


def _with_param(
    name: str, values: st.SearchStrategy[float] | st.SearchStrategy[int]
) -> st.SearchStrategy[tuple[str, common_pb2.SamplingParams]]:
    def params(value: float) -> tuple[str, common_pb2.SamplingParams]:
        msg = common_pb2.SamplingParams()
        setattr(msg, name, value)
        return name, msg

    return values.map(params)


def _bad_request_fields() -> st.SearchStrategy[tuple[str, inference_pb2.GenerateTextRequest]]:
    deadlines = (
        st.floats(max_value=-1e-300)
        | st.floats(min_value=MAX_DEADLINE_S, exclude_min=True)
        | st.just(math.nan)
    )
    policies = st.text(min_size=1, max_size=16).filter(
        lambda p: p.strip().lower().replace("-", "_") not in POLICY_NAMES
    )
    request = inference_pb2.GenerateTextRequest
    return st.one_of(
        deadlines.map(lambda d: ("deadline_s", request(text="hi", deadline_s=d))),
        policies.map(lambda p: ("routing_policy", request(text="hi", routing_policy=p))),
        st.text(min_size=1, max_size=16)
        .filter(lambda m: m != MODEL)
        .map(lambda m: ("model", request(text="hi", model=m))),
        st.lists(st.integers(50_000, 2**32 - 1), min_size=1, max_size=4).map(
            lambda ids: ("token_ids", request(token_ids=inference_pb2.TokenIds(ids=ids)))
        ),
        st.integers(255, 20_000).map(lambda n: ("text", request(text="x" * n))),
        st.just(("chat", request(chat=inference_pb2.ChatMessages()))),
    )


def varint(value: int) -> bytes:
    assert 0 <= value < 2**64, f"a varint holds 64 bits, got {value}"
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def tag(field_number: int, wire_type: int) -> bytes:
    return varint(field_number << 3 | wire_type)


def length_delimited(field_number: int, payload: bytes) -> bytes:
    return tag(field_number, LEN) + varint(len(payload)) + payload


def malformed(rpc: str) -> st.SearchStrategy[tuple[str, bytes]]:
    """(family, bytes) for one Inference RPC's request; most of them do not parse."""
    return malformed_bytes(VALID_MESSAGES[rpc])


def malformed_bytes(valid_message: Message) -> st.SearchStrategy[tuple[str, bytes]]:
    """(family, bytes) near ``valid_message``'s type and encoding; most do not parse."""
    descriptor = valid_message.DESCRIPTOR
    valid = valid_message.SerializeToString()
    families: list[st.SearchStrategy[tuple[str, bytes]]] = [
        st.binary(max_size=300).map(lambda b: ("random", b)),
        _huge_length_prefixes(descriptor).map(lambda b: ("huge-length", b)),
        _wrong_wire_types(descriptor).map(lambda b: ("wire-type", b)),
        _deep_groups().map(lambda b: ("groups", b)),
        _overlong_varints().map(lambda b: ("long-varint", b)),
    ]
    if valid:
        truncated = st.integers(1, len(valid) - 1).map(lambda k: valid[:k])
        families.append(truncated.map(lambda b: ("truncated", b)))
    string_paths = _string_field_paths(descriptor)
    if string_paths:
        families.append(_invalid_utf8(string_paths).map(lambda b: ("bad-utf8", b)))
    return st.one_of(families)


def unknown_fields(rpc: str) -> st.SearchStrategy[bytes]:
    """The valid request plus unknown fields, which a parser must skip."""
    valid = VALID_MESSAGES[rpc].SerializeToString()
    known = {f.number for f in RPCS[rpc].DESCRIPTOR.fields}
    numbers = st.integers(1, _MAX_FIELD_NUMBER).filter(
        lambda n: n not in known and n not in _RESERVED_FIELD_NUMBERS
    )
    one = st.tuples(numbers, st.sampled_from([VARINT, FIXED64, LEN, START_GROUP, FIXED32]))
    fields = st.lists(one.flatmap(lambda nw: _field_value(*nw)), min_size=1, max_size=5)
    return fields.map(lambda extra: valid + b"".join(extra))


def _field_value(number: int, wire_type: int) -> st.SearchStrategy[bytes]:
    if wire_type == VARINT:
        return st.integers(0, 2**64 - 1).map(lambda v: tag(number, VARINT) + varint(v))
    if wire_type == FIXED64:
        return st.binary(min_size=8, max_size=8).map(lambda b: tag(number, FIXED64) + b)
    if wire_type == FIXED32:
        return st.binary(min_size=4, max_size=4).map(lambda b: tag(number, FIXED32) + b)
    if wire_type == LEN:
        return st.binary(max_size=40).map(lambda b: length_delimited(number, b))
    return st.just(tag(number, START_GROUP) + tag(number, END_GROUP))


def _huge_length_prefixes(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    numbers = [f.number for f in descriptor.fields] or [1]
    return st.tuples(
        st.sampled_from(numbers), st.binary(max_size=16), st.integers(17, 2**64 - 1)
    ).map(lambda t: tag(t[0], LEN) + varint(t[2]) + t[1])


def _wrong_wire_types(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    fields = [(f.number, _natural_wire_type(f)) for f in descriptor.fields] or [(1, VARINT)]
    return st.sampled_from(fields).flatmap(
        lambda nf: st.sampled_from(
            [w for w in (VARINT, FIXED64, LEN, START_GROUP, FIXED32) if w != nf[1]]
        ).flatmap(lambda w: _field_value(nf[0], w))
    )


def _natural_wire_type(f: FieldDescriptor) -> int:
    if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FIXED64):
        return FIXED64
    if f.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_FIXED32):
        return FIXED32
    scalar = f.type not in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE)
    return VARINT if scalar and not f.is_repeated else LEN


def _deep_groups() -> st.SearchStrategy[bytes]:
    """Nested start-group tags, closed or not: beyond the parser's depth limit when deep."""
    return st.tuples(st.integers(1, 5000), st.booleans()).map(
        lambda t: tag(1, START_GROUP) * t[0] + (tag(1, END_GROUP) * t[0] if t[1] else b"")
    )


def _overlong_varints() -> st.SearchStrategy[bytes]:
    """A varint of more than the 10 bytes a 64-bit value can need."""
    return st.integers(10, 30).map(lambda k: tag(1, VARINT) + b"\xff" * k + b"\x01")


def _string_field_paths(descriptor: Descriptor, depth: int = 0) -> list[tuple[int, ...]]:
    """Field-number paths to every string field, through nested messages."""
    paths: list[tuple[int, ...]] = []
    for f in descriptor.fields:
        if f.type == FieldDescriptor.TYPE_STRING:
            paths.append((f.number,))
        elif f.type == FieldDescriptor.TYPE_MESSAGE and depth < 3:
            paths.extend((f.number, *p) for p in _string_field_paths(f.message_type, depth + 1))
    return paths


def _invalid_utf8(paths: list[tuple[int, ...]]) -> st.SearchStrategy[bytes]:
    blobs = st.binary(min_size=1, max_size=24).map(lambda b: b + b"\xc3")  # cut a 2-byte char
    return st.tuples(st.sampled_from(paths), blobs).map(lambda t: _nest(t[0], t[1]))


def _nest(path: tuple[int, ...], payload: bytes) -> bytes:
    for number in reversed(path):
        payload = length_delimited(number, payload)
    return payload
