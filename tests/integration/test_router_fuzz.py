"""Fuzzing the router (issue 4): >= 1,000 generated bad HTTP requests, malformed protobuf.

One router (real HTTP and gRPC servers on loopback) in front of a STUB worker. Every bad
HTTP request must get a 4xx in OpenAI's error shape, never a 5xx; every malformed protobuf
must get INVALID_ARGUMENT naming the message, never UNKNOWN or INTERNAL; afterwards the
router still serves valid requests with the right output.

Bad bodies come from the OpenAPI schema the router publishes (``openapi_fuzz``), plus
families the schema cannot express: non-JSON numbers, invalid UTF-8, truncated and random
bodies, wrong content types, deep nesting, oversized prompts, wrong paths and methods.
Hypothesis runs derandomized, so CI sends the same requests every time. The last test
checks the totals, so run the whole file.
"""

from __future__ import annotations

import json
import math
import re
import string
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import grpc
import httpx
import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from pdserve.proto import common_pb2, inference_pb2
from pdserve.router.edge.grpc_server import MAX_DEADLINE_S
from tests.integration.fuzzing import fuzz
from tests.integration.grpc_fuzz import (
    RPCS,
    VALID_MESSAGES,
    bad_generate_requests,
    call_raw,
    malformed,
    parses,
    reply_content,
    unknown_fields,
)
from tests.integration.openapi_fuzz import BadRequest, OpenApiFuzzer
from tests.integration.stub_worker import StubCluster, start_stub_cluster

MODEL = "fake-model"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
VALID_BODIES: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"model": MODEL, "prompt": "hi", "max_tokens": 1},
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
}
STREAMING = {"stream": True, "stream_options": {"include_usage": True}}
PROMPT_LIMIT_TOKENS = 255  # FakeCharTokenizer: 256-token context, one token per char + BOS
MIN_BAD_HTTP_REQUESTS = 1000
MIN_BAD_GRPC_REQUESTS = 300
S = grpc.StatusCode


@dataclass
class Tally:
    """What the fuzz sent and what came back, over the whole module."""

    http_status: Counter[int] = field(default_factory=Counter)
    http_family: Counter[str] = field(default_factory=Counter)
    grpc_code: Counter[str] = field(default_factory=Counter)
    grpc_family: Counter[str] = field(default_factory=Counter)
    valid_http_status: Counter[int] = field(default_factory=Counter)  # not bad requests


@pytest.fixture(scope="module")
def cluster() -> Iterator[StubCluster]:
    cluster = start_stub_cluster({"w0": "colocated"})
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def http(cluster: StubCluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.http_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def channel(cluster: StubCluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        yield channel


@pytest.fixture(scope="module")
def tally() -> Tally:
    return Tally()


@pytest.fixture(scope="module")
def fuzzer(http: httpx.Client) -> OpenApiFuzzer:
    return OpenApiFuzzer(http.get("/openapi.json").raise_for_status().json())


@pytest.fixture(scope="module")
def schema_bad_requests(fuzzer: OpenApiFuzzer) -> st.SearchStrategy[tuple[str, BadRequest]]:
    per_base = [
        fuzzer.bad_requests(path, base).map(lambda bad, p=path: (p, bad))
        for path, body in VALID_BODIES.items()
        for base in (body, {**body, **STREAMING})
    ]
    return st.one_of(per_base)


def send(
    http: httpx.Client,
    tally: Tally,
    family: str,
    method: str,
    path: str,
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    """Send one bad request; assert a 4xx with OpenAI's error body and return both."""
    response = http.request(method, path, content=content, headers=headers)
    tally.http_status[response.status_code] += 1
    tally.http_family[family] += 1
    shown = f"{family}: {method} {path} {(content or b'')[:200]!r} -> {response.status_code}"
    assert 400 <= response.status_code < 500, f"{shown}: {response.text[:500]}"
    body = response.json()
    assert set(body) == {"error"}, f"{shown}: {body}"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, f"{shown}: {error}"
    assert isinstance(error["message"], str) and error["message"], f"{shown}: {error}"
    assert error["type"] == "invalid_request_error", f"{shown}: {error}"
    return response.status_code, error


def post_json(
    http: httpx.Client, tally: Tally, family: str, path: str, body: Any, **headers: str
) -> tuple[int, dict[str, Any]]:
    content = json.dumps(body).encode()
    headers = {"content-type": "application/json", **headers}
    return send(http, tally, family, "POST", path, content, headers)


# --- HTTP: bodies the published schema rejects --------------------------------------------


@fuzz(700)
@given(data=st.data())
def test_schema_invalid_requests_are_400_naming_the_field(
    http: httpx.Client,
    tally: Tally,
    schema_bad_requests: st.SearchStrategy[tuple[str, BadRequest]],
    data: st.DataObject,
) -> None:
    path, bad = data.draw(schema_bad_requests)
    content = json.dumps(bad.body).encode()
    headers = {"content-type": "application/json", **bad.headers}
    status, error = send(http, tally, f"schema:{bad.broken}", "POST", path, content, headers)
    assert status == 400, error
    if bad.field is not None:
        assert (error["param"] or "").split(".")[0] == bad.field, (bad, error)
        assert bad.field in error["message"], (bad, error)
    if bad.broken == "property" and bad.field == "model" and isinstance(bad.body["model"], str):
        assert error["code"] == "model_not_found", (bad, error)


@fuzz(120)
@given(data=st.data())
def test_bad_chat_messages_are_400_naming_the_message(
    http: httpx.Client, tally: Tally, fuzzer: OpenApiFuzzer, data: st.DataObject
) -> None:
    messages_schema = fuzzer.request_schema(CHAT)["properties"]["messages"]
    messages = data.draw(fuzzer.invalid_value(messages_schema))
    status, error = post_json(
        http, tally, "chat", CHAT, {**VALID_BODIES[CHAT], "messages": messages}
    )
    assert status == 400 and (error["param"] or "").startswith("messages"), error


def _sse_payloads(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.splitlines() if line]


@fuzz(100)
@given(data=st.data(), path=st.sampled_from(sorted(VALID_BODIES)))
def test_schema_valid_requests_are_served_or_refused_never_5xx(
    http: httpx.Client, tally: Tally, fuzzer: OpenApiFuzzer, data: st.DataObject, path: str
) -> None:
    """The other side of the schema: what it accepts must not break the router either."""
    body = data.draw(fuzzer.valid_value(fuzzer.request_schema(path)))
    body.pop("max_completion_tokens", None)
    body["max_tokens"] = data.draw(st.integers(1, 4))  # short answers keep the fuzz fast
    response = http.post(
        path, content=json.dumps(body), headers={"content-type": "application/json"}
    )
    tally.valid_http_status[response.status_code] += 1
    shown = f"{body!r:.500} -> {response.status_code}: {response.text[:500]}"
    # 400 is still possible: a lone surrogate in a string, say, is JSON but not Unicode.
    assert response.status_code in (200, 400), shown
    if response.status_code == 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}, shown
    elif body.get("stream"):
        events = _sse_payloads(response.text)
        assert events[-1] == "[DONE]", shown
        assert not any(e.startswith('{"error"') for e in events), shown
    else:
        assert len(response.json()["choices"]) == body.get("n", 1), shown


# --- HTTP: what a JSON Schema cannot say ---------------------------------------------------

NUMBER_FIELDS = ("max_tokens", "temperature", "top_p", "n", "seed", "top_k", "min_p", "logprobs")
NOT_JSON_OR_TOO_BIG = (
    *("NaN", "Infinity", "-Infinity", "1e400", "-1e400"),  # not JSON, or not finite
    *("1" + "0" * 5000, "-" + "9" * 5000),  # beyond Python's 4,300-digit int parsing limit
    *("0x10", "+1", ".5", "01", "1.", "--1", "1e", "1_000"),  # not JSON numbers
)


@fuzz(90)
@given(
    path=st.sampled_from(sorted(VALID_BODIES)),
    name=st.sampled_from(NUMBER_FIELDS),
    token=st.sampled_from(NOT_JSON_OR_TOO_BIG),
)
def test_non_finite_huge_and_malformed_numbers_are_400(
    http: httpx.Client, tally: Tally, path: str, name: str, token: str
) -> None:
    content = json.dumps(VALID_BODIES[path])[:-1] + f', "{name}": {token}}}'
    headers = {"content-type": "application/json"}
    assert send(http, tally, "numbers", "POST", path, content.encode(), headers)[0] == 400


# Never valid UTF-8, whatever surrounds them: not lead bytes, an overlong form, a surrogate.
_NOT_UTF8 = st.sampled_from([b"\xff", b"\xfe", b"\xc0\xaf", b"\xed\xa0\x80"])


@fuzz(60)
@given(
    path=st.sampled_from(sorted(VALID_BODIES)),
    blob=st.tuples(st.binary(max_size=32), _NOT_UTF8, st.binary(max_size=32)).map(b"".join),
)
def test_invalid_utf8_in_a_string_is_400(
    http: httpx.Client, tally: Tally, path: str, blob: bytes
) -> None:
    content = json.dumps(VALID_BODIES[path]).encode().replace(b'"hi"', b'"' + blob + b'"')
    headers = {"content-type": "application/json"}
    assert send(http, tally, "utf8", "POST", path, content, headers)[0] == 400


@fuzz(100)
@given(path=st.sampled_from(sorted(VALID_BODIES)), data=st.data())
def test_truncated_and_random_bodies_are_400(
    http: httpx.Client, tally: Tally, path: str, data: st.DataObject
) -> None:
    valid = json.dumps(VALID_BODIES[path]).encode()
    truncated = st.integers(0, len(valid) - 1).map(lambda k: valid[:k])
    content = data.draw(truncated | st.binary(max_size=512))
    headers = {"content-type": "application/json"}
    assert send(http, tally, "raw", "POST", path, content, headers)[0] == 400


def _is_json_type(content_type: str) -> bool:
    main, _, sub = content_type.partition(";")[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


@fuzz(50)
@given(
    path=st.sampled_from(sorted(VALID_BODIES)),
    content_type=st.sampled_from(["text/plain", "application/xml", "multipart/form-data; b=x",
                                  "application/x-www-form-urlencoded", "application/jsonl"])
    | st.from_regex(r"\A[a-z]{1,10}/[a-z0-9.+-]{1,16}\Z"),
)  # fmt: skip
def test_valid_json_with_a_non_json_content_type_is_400(
    http: httpx.Client, tally: Tally, path: str, content_type: str
) -> None:
    if _is_json_type(content_type):
        return  # such a request is valid
    content = json.dumps(VALID_BODIES[path]).encode()
    headers = {"content-type": content_type}
    assert send(http, tally, "content-type", "POST", path, content, headers)[0] == 400


@fuzz(40)
@given(
    path=st.sampled_from(sorted(VALID_BODIES)),
    depth=st.integers(2, 200_000),
    opener=st.sampled_from(["[", '{"a":']),
    whole_body=st.booleans(),
)
def test_deeply_nested_json_is_400(
    http: httpx.Client, tally: Tally, path: str, depth: int, opener: str, whole_body: bool
) -> None:
    inner, closer = ("[]", "]") if opener == "[" else ("1", "}")
    nested = opener * depth + inner + closer * depth
    if not whole_body:  # nested where the prompt goes
        name = "prompt" if path == COMPLETIONS else "messages"
        rest = {k: v for k, v in VALID_BODIES[path].items() if k != name}
        nested = json.dumps(rest)[:-1] + f', "{name}": {nested}}}'
    headers = {"content-type": "application/json"}
    assert send(http, tally, "nesting", "POST", path, nested.encode(), headers)[0] == 400


def _oversized(kind: str, chars: int) -> tuple[str, dict[str, Any]]:
    """A body whose prompt is ``chars`` long: beyond the context for any ``chars`` >= 255."""
    if kind == "text":
        return COMPLETIONS, {"model": MODEL, "prompt": "x" * chars}
    if kind == "token_ids":
        return COMPLETIONS, {"model": MODEL, "prompt": [7] * (chars + 1)}
    if kind == "batch":
        return COMPLETIONS, {"model": MODEL, "prompt": ["x" * chars]}
    if kind == "chat":
        return CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x" * chars}]}
    many = [{"role": "user", "content": "x"}] * max(26, chars // 100)  # 10 tokens each
    return CHAT, {"model": MODEL, "messages": many}


@fuzz(50)
@given(
    kind=st.sampled_from(["text", "token_ids", "batch", "chat", "many_messages"]),
    chars=st.integers(PROMPT_LIMIT_TOKENS, 400_000),
)
def test_oversized_prompts_are_400_context_length_exceeded(
    http: httpx.Client, tally: Tally, kind: str, chars: int
) -> None:
    path, body = _oversized(kind, chars)
    status, error = post_json(http, tally, "oversized", path, body)
    assert status == 400 and error["code"] == "context_length_exceeded", error
    assert error["param"] == ("prompt" if path == COMPLETIONS else "messages"), error


GET_ROUTES = ("/health", "/v1/models", "/openapi.json", "/docs", "/docs/oauth2-redirect",
              "/redoc", "/metrics", "/dashboard", "/dashboard/data",
              "/dashboard/static/charts.js", "/dashboard/static/dashboard.js",
              "/dashboard/static/dashboard.css")  # fmt: skip
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")  # HEAD answers have no body
# Non-empty segments: "/v1/models/" would get Starlette's trailing-slash redirect (307).
_SEGMENT = st.text(string.ascii_letters + string.digits + "-_~%", min_size=1, max_size=12)
_PATHS = st.tuples(
    st.sampled_from(["", "/v1", "/v1/chat", "/dashboard", "/dashboard/static", "/v2"]),
    st.lists(_SEGMENT, min_size=1, max_size=3),
).map(lambda t: t[0] + "/" + "/".join(t[1]))
_WRONG_METHODS = [(m, p) for p in VALID_BODIES for m in METHODS if m != "POST"] + [
    (m, p) for p in GET_ROUTES for m in METHODS if m != "GET"
]


@fuzz(120)
@given(request=st.tuples(st.sampled_from(METHODS), _PATHS) | st.sampled_from(_WRONG_METHODS))
def test_unknown_paths_are_404_and_wrong_methods_405(
    http: httpx.Client, tally: Tally, request: tuple[str, str]
) -> None:
    method, path = request
    served_path = unquote(path)  # what the server routes on
    known = set(GET_ROUTES) | set(VALID_BODIES)
    status, _ = send(http, tally, "paths", method, path, b"{}")
    # "/dashboard/static/{name}" is a route for any one-segment name (a GET of others: 404).
    asset_route = re.fullmatch(r"/dashboard/static/[^/]+", served_path) is not None
    assert status == (405 if served_path in known or (asset_route and method != "GET") else 404)


# --- gRPC: malformed protobuf and bad values -----------------------------------------------

_NEVER = (S.UNKNOWN, S.INTERNAL, S.UNAVAILABLE)


@pytest.fixture(scope="module")
def reference_replies(channel: grpc.Channel) -> dict[str, list[Message]]:
    """Each RPC's replies to its valid request, for comparing what unknown fields change."""
    out = {}
    for rpc, message in VALID_MESSAGES.items():
        code, details, replies = call_raw(channel, rpc, message.SerializeToString())
        assert code is S.OK, f"{rpc}: {code} {details}"
        out[rpc] = reply_content(replies)
    return out


def tally_grpc(tally: Tally, family: str, code: grpc.StatusCode) -> None:
    tally.grpc_code[code.name] += 1
    tally.grpc_family[f"{family} {code.name}"] += 1


@fuzz(240)
@given(data=st.data(), rpc=st.sampled_from(sorted(RPCS)))
def test_malformed_protobuf_is_invalid_argument(
    channel: grpc.Channel, tally: Tally, data: st.DataObject, rpc: str
) -> None:
    family, raw = data.draw(malformed(rpc))
    code, details, _ = call_raw(channel, rpc, raw)
    tally_grpc(tally, family, code)
    shown = f"{rpc} {family} {raw[:80]!r}: {code.name} {details}"
    assert code not in _NEVER, shown
    if not parses(RPCS[rpc], raw):
        assert code is S.INVALID_ARGUMENT, shown
        assert RPCS[rpc].DESCRIPTOR.full_name in details, shown
    else:  # well-formed after all (unknown fields, say): served, or refused for its values
        assert code in (S.OK, S.INVALID_ARGUMENT, S.DEADLINE_EXCEEDED), shown


@fuzz(60)
@given(data=st.data(), rpc=st.sampled_from(sorted(RPCS)))
def test_unknown_fields_are_ignored(
    channel: grpc.Channel,
    tally: Tally,
    reference_replies: dict[str, list[Message]],
    data: st.DataObject,
    rpc: str,
) -> None:
    raw = data.draw(unknown_fields(rpc))
    code, details, replies = call_raw(channel, rpc, raw)
    tally_grpc(tally, "unknown-fields", code)
    assert code is S.OK, f"{rpc} {raw!r}: {code.name} {details}"
    assert reply_content(replies) == reference_replies[rpc]


@fuzz(120)
@given(case=bad_generate_requests())
def test_out_of_range_values_are_invalid_argument_naming_the_field(
    channel: grpc.Channel, tally: Tally, case: tuple[str, inference_pb2.GenerateTextRequest]
) -> None:
    name, request = case
    code, details, _ = call_raw(channel, "Generate", request.SerializeToString())
    tally_grpc(tally, "values", code)
    assert code is S.INVALID_ARGUMENT, f"{name}: {request}: {code.name} {details}"
    assert name in details, f"{name}: {details}"


@pytest.mark.parametrize("deadline_s", [math.inf, math.nan, 1e10, 2 * MAX_DEADLINE_S, -1.0])
def test_deadline_out_of_range_is_invalid_argument(
    channel: grpc.Channel, deadline_s: float
) -> None:
    """Regression: inf or > ~1e9 s overflowed gRPC timeouts (UNAVAILABLE); NaN meant none."""
    request = inference_pb2.GenerateTextRequest(text="hi", deadline_s=deadline_s)
    code, details, _ = call_raw(channel, "Generate", request.SerializeToString())
    assert code is S.INVALID_ARGUMENT and "deadline_s" in details, f"{code.name} {details}"
    fine = inference_pb2.GenerateTextRequest(text="hi", deadline_s=MAX_DEADLINE_S)
    assert call_raw(channel, "Generate", fine.SerializeToString())[0] is S.OK


def test_a_message_over_the_size_limit_is_resource_exhausted(
    cluster: StubCluster, channel: grpc.Channel
) -> None:
    too_big = cluster.config.max_message_bytes + 1
    request = inference_pb2.GenerateTextRequest(text="x" * too_big)
    code, details, _ = call_raw(channel, "Generate", request.SerializeToString())
    assert code is S.RESOURCE_EXHAUSTED, f"{code.name} {details}"


# --- regressions: bugs the fuzz found ------------------------------------------------------


def test_http_requests_must_name_a_model(http: httpx.Client) -> None:
    """Regression: model "" was served with the default model; the schema says it is not."""
    for path, body in VALID_BODIES.items():
        response = http.post(path, json={**body, "model": ""})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("model", "model_not_found"), error
        assert MODEL in error["message"]  # it says which models there are


def test_chat_max_completion_tokens_errors_name_that_field(http: httpx.Client) -> None:
    """Regression: a bad max_completion_tokens was reported as max_tokens."""
    body = {**VALID_BODIES[CHAT], "max_tokens": None, "max_completion_tokens": 5000}
    response = http.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_completion_tokens", error
    assert error["message"].startswith("max_completion_tokens must be in [1, "), error
    both = {**body, "max_tokens": 5000, "max_completion_tokens": 2}  # max_tokens over the limit
    assert http.post(CHAT, json=both).json()["error"]["param"] == "max_tokens"


# --- after all that: still serving ----------------------------------------------------------


def test_router_still_serves_after_the_fuzz(
    http: httpx.Client, channel: grpc.Channel, tally: Tally
) -> None:
    """Counts of the whole module, then valid requests over both APIs."""
    print(f"\nHTTP {sum(tally.http_status.values())} bad requests: {dict(tally.http_status)}")
    print(f"  by family: {dict(tally.http_family)}")
    print(f"gRPC {sum(tally.grpc_code.values())} requests: {dict(tally.grpc_code)}")
    print(f"  by family: {dict(tally.grpc_family)}")
    print(f"HTTP schema-valid requests: {dict(tally.valid_http_status)}")
    assert sum(tally.http_status.values()) >= MIN_BAD_HTTP_REQUESTS, "run the whole file"
    assert all(400 <= status < 500 for status in tally.http_status)
    assert sum(tally.grpc_code.values()) >= MIN_BAD_GRPC_REQUESTS, "run the whole file"
    assert not {c.name for c in _NEVER} & set(tally.grpc_code)

    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pdserve.v1.Inference"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    request = inference_pb2.GenerateTextRequest(
        text="hello", params=common_pb2.SamplingParams(max_tokens=3)
    )
    code, details, replies = call_raw(channel, "Generate", request.SerializeToString())
    assert code is S.OK, details
    assert [r.chunk.text for r in replies] == [" w0", " w1", " w2"]
    assert replies[-1].chunk.finish_reason == "length"

    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
    response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == [" w0 w1 w2"]
    assert http.get("/health").json() == {"status": "ok", "workers": 1}
