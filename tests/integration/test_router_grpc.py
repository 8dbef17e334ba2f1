"""The router's gRPC API on loopback, in front of STUB workers (real gRPC servers)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.proto import common_pb2, inference_pb2, inference_pb2_grpc
from pdserve.router.config import RouterConfig
from tests.integration.stub_worker import StubCluster, start_stub_cluster

S = grpc.StatusCode


@pytest.fixture(scope="module")
def cluster() -> Iterator[StubCluster]:
    cluster = start_stub_cluster({"w0": "colocated"})
    yield cluster
    cluster.stop()


@pytest.fixture()
def channel(cluster: StubCluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        yield channel


def generate(channel: grpc.Channel, **fields) -> list[inference_pb2.GenerateTextResponse]:
    stub = inference_pb2_grpc.InferenceStub(channel)
    return list(stub.Generate(inference_pb2.GenerateTextRequest(**fields), timeout=10))


def test_generate_streams_chunks_then_usage(channel: grpc.Channel) -> None:
    params = common_pb2.SamplingParams(max_tokens=3, temperature=0.0)
    responses = generate(channel, text="hello", params=params)
    assert [r.chunk.text for r in responses] == [" w0", " w1", " w2"]
    assert [list(r.chunk.token_ids) for r in responses] == [[1000], [1001], [1002]]
    assert responses[-1].chunk.finish_reason == "length"
    last = responses[-1]
    assert last.HasField("usage") and last.HasField("timing")
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (6, 3)  # BOS + 5 chars
    assert last.timing.e2e_s >= last.timing.ttft_s > 0
    assert last.prefill_worker == "w0" and last.decode_worker == ""
    assert len({r.request_id for r in responses}) == 1
    assert not responses[0].HasField("usage")


def test_generate_with_token_ids_chat_and_n(channel: grpc.Channel, cluster: StubCluster) -> None:
    ids = inference_pb2.TokenIds(ids=[1, 72, 105])
    responses = generate(
        channel, token_ids=ids, params=common_pb2.SamplingParams(max_tokens=2, n=2)
    )
    texts = {(r.chunk.index, r.chunk.text) for r in responses}
    assert texts == {(0, " w0"), (0, " w1"), (1, " s1w0"), (1, " s1w1")}
    assert responses[-1].usage.completion_tokens == 4
    chat = inference_pb2.ChatMessages(
        messages=[inference_pb2.ChatMessage(role="user", content="hi")]
    )
    assert (
        generate(channel, chat=chat)[-1].usage.prompt_tokens == len("<|user|>hi\n<|assistant|>") + 1
    )


def test_tokenize_and_list_models(channel: grpc.Channel) -> None:
    stub = inference_pb2_grpc.InferenceStub(channel)
    tokens = stub.Tokenize(inference_pb2.TokenizeRequest(text="Hi"), timeout=5)
    assert list(tokens.token_ids) == [1, 72, 105]
    assert tokens.max_context_tokens == 256
    models = stub.ListModels(inference_pb2.ListModelsRequest(), timeout=5)
    assert [(m.id, m.max_context_tokens) for m in models.models] == [("fake-model", 256)]


def test_health_check_and_reflection(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pdserve.v1.Inference"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    reply = next(iter(reflection.ServerReflectionInfo(iter([request]), timeout=5)))
    names = {s.name for s in reply.list_services_response.service}
    assert {"pdserve.v1.Inference", "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"text": "hi", "params": common_pb2.SamplingParams(temperature=-1.0)}, "temperature"),
        ({"text": "hi", "params": common_pb2.SamplingParams(top_p=0.0)}, "top_p"),
        ({"text": "hi", "params": common_pb2.SamplingParams(max_tokens=0)}, "max_tokens"),
        ({"text": "x" * 300}, "text"),
        ({"text": "hi", "model": "gpt-9"}, "model"),
        ({"text": "hi", "routing_policy": "nearest"}, "routing_policy"),
        ({"token_ids": inference_pb2.TokenIds(ids=[60000])}, "token_ids"),
        ({}, "prompt"),
    ],
)
def test_bad_inputs_are_invalid_argument_naming_the_field(
    channel: grpc.Channel, fields: dict, field_name: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        generate(channel, **fields)
    assert caught.value.code() is S.INVALID_ARGUMENT
    assert field_name in caught.value.details()
    assert generate(channel, text="still serving")[-1].chunk.finish_reason  # server keeps serving


def test_malformed_protobuf_bytes_are_invalid_argument(channel: grpc.Channel) -> None:
    raw = channel.unary_stream("/pdserve.v1.Inference/Generate")  # no serializers: raw bytes
    with pytest.raises(grpc.RpcError) as caught:
        list(raw(b"\x0a\xff\xff\xff", timeout=5))
    assert caught.value.code() is S.INVALID_ARGUMENT
    assert "GenerateTextRequest" in caught.value.details()
    assert generate(channel, text="still serving")[-1].chunk.finish_reason


def test_api_key_is_required_when_configured() -> None:
    cluster = start_stub_cluster({"w0": "colocated"}, RouterConfig(api_keys=("s3cret",)))
    try:
        with grpc.insecure_channel(cluster.grpc_address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = inference_pb2.ListModelsRequest()
            for metadata in [None, (("authorization", "Bearer wrong"),)]:
                with pytest.raises(grpc.RpcError) as caught:
                    stub.ListModels(request, metadata=metadata, timeout=5)
                assert caught.value.code() is S.UNAUTHENTICATED
                assert "s3cret" not in caught.value.details()
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(inference_pb2.GenerateTextRequest(text="hi"), timeout=5))
            assert caught.value.code() is S.UNAUTHENTICATED
            good = (("authorization", "Bearer s3cret"),)
            assert stub.ListModels(request, metadata=good, timeout=5).models
            health = health_pb2_grpc.HealthStub(channel)  # probes carry no key
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
    finally:
        cluster.stop()
