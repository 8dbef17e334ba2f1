"""The OpenAI-compatible HTTP API with the official openai client, in front of STUB workers."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from pdserve.proto.params import params_from_proto
from pdserve.router.config import RouterConfig
from tests.integration.stub_worker import StubCluster, start_stub_cluster

MODEL = "fake-model"


@pytest.fixture(scope="module")
def cluster() -> Iterator[StubCluster]:
    cluster = start_stub_cluster({"w0": "colocated"})
    yield cluster
    cluster.stop()


@pytest.fixture()
def client(cluster: StubCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_completion(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [(0, " w0 w1 w2", "length")]
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        6,
        3,
        9,
    )


def test_completion_with_token_ids_n_and_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=[1, 72, 105], max_tokens=2, n=2, logprobs=2)
    by_index = {c.index: c for c in out.choices}
    assert by_index[0].text == " w0 w1" and by_index[1].text == " s1w0 s1w1"
    logprobs = by_index[0].logprobs
    assert logprobs is not None
    assert logprobs.token_logprobs == [-0.25, -0.5]
    assert logprobs.tokens == [chr(1000), chr(1001)]  # the fake tokenizer decodes code points
    assert logprobs.text_offset == [0, 1]
    assert logprobs.top_logprobs == [
        {chr(1000): -0.25, chr(1001): -1.25},
        {chr(1001): -0.5, chr(1002): -1.5},
    ]
    assert out.usage is not None and out.usage.completion_tokens == 4


def test_completion_stop_string(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=10, stop=[" w3"])
    assert out.choices[0].text == " w0 w1 w2"
    assert out.choices[0].finish_reason == "stop"


def test_streamed_completion_with_usage(client: openai.OpenAI) -> None:
    events = list(
        client.completions.create(
            model=MODEL,
            prompt="Hi",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [e.choices[0].text for e in events if e.choices]
    assert texts == [" w0", " w1", " w2"]
    assert [e.choices[0].finish_reason for e in events if e.choices] == [None, None, "length"]
    assert events[-1].choices == [] and events[-1].usage is not None
    assert events[-1].usage.completion_tokens == 3


def test_chat_completion(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, n=2)
    assert out.object == "chat.completion"
    contents = sorted((c.index, c.message.role, c.message.content) for c in out.choices)
    assert contents == [(0, "assistant", " w0 w1"), (1, "assistant", " s1w0 s1w1")]
    prompt = "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt) + 1


def test_streamed_chat_with_logprobs_and_stop(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        stream=True,
        stop=" w2",
        logprobs=True,
        top_logprobs=1,
    )
    events = list(stream)
    assert events[0].choices[0].delta.role == "assistant"
    text = "".join(e.choices[0].delta.content or "" for e in events)
    assert text == " w0 w1"
    assert events[-1].choices[0].finish_reason == "stop"
    first = events[0].choices[0].logprobs
    assert first is not None and first.content is not None
    assert first.content[0].logprob == -0.25 and len(first.content[0].top_logprobs) == 1


def test_models_and_health(cluster: StubCluster, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    health = httpx.get(f"{cluster.http_url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "workers": 1}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ({"model": MODEL, "prompt": "x" * 300}, "prompt"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 255}, "max_tokens"),
        ({"model": "gpt-9", "prompt": "hi"}, "model"),
        ({"model": MODEL, "prompt": 42}, "prompt"),
        ({"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
        ({"model": MODEL, "prompt": [70000]}, "prompt"),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, "n"),
        ({"model": MODEL, "prompt": "hi", "routing_policy": "nearest"}, "routing_policy"),
        ({"model": MODEL, "prompt": "hi", "speculative": "no"}, "speculative"),
    ],
)
def test_bad_completion_inputs_are_400_naming_the_field(
    cluster: StubCluster, body: dict, field: str
) -> None:
    response = httpx.post(f"{cluster.http_url}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field and field in error["message"]
    ok = httpx.post(f"{cluster.http_url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert ok.status_code == 200  # the server keeps serving


def test_speculative_false_reaches_the_worker(cluster: StubCluster) -> None:
    url = f"{cluster.http_url}/v1/completions"
    record = cluster.workers["w0"].record
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for speculative, expected_set in [(False, True), (True, False)]:
        response = httpx.post(url, json={**body, "speculative": speculative})
        assert response.status_code == 200, response.text
        sent = record.params[-1]
        # only an opt-out travels; true is the default, so the field stays unset
        assert sent.HasField("speculative") == expected_set
        assert params_from_proto(sent).speculative is speculative


def test_bad_json_and_bad_chat_are_400(cluster: StubCluster) -> None:
    url = f"{cluster.http_url}/v1/chat/completions"
    response = httpx.post(
        url,
        content=b'{"model": "fake-model", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]
    for body, field in [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 99},
            "top_logprobs",
        ),
    ]:
        response = httpx.post(url, json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field


def test_routing_policy_header(cluster: StubCluster) -> None:
    url = f"{cluster.http_url}/v1/completions"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    good = httpx.post(url, json=body, headers={"x-pdserve-routing-policy": "least_loaded"})
    assert good.status_code == 200
    bad = httpx.post(url, json=body, headers={"x-pdserve-routing-policy": "nearest"})
    assert bad.status_code == 400 and "x-pdserve-routing-policy" in bad.json()["error"]["message"]


def test_openapi_documents_400_not_422(cluster: StubCluster) -> None:
    schema = httpx.get(f"{cluster.http_url}/openapi.json").json()
    operation = schema["paths"]["/v1/completions"]["post"]
    assert "422" not in operation["responses"]
    assert {"200", "400", "429", "503"} <= set(operation["responses"])
    assert "text/event-stream" in operation["responses"]["200"]["content"]
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_api_key_required_when_configured() -> None:
    cluster = start_stub_cluster({"w0": "colocated"}, RouterConfig(api_keys=("k1", "k2")))
    try:
        url = f"{cluster.http_url}/v1"
        with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError) as caught:
                bad.models.list()
            assert "k1" not in str(caught.value)
        with openai.OpenAI(base_url=url, api_key="k2", max_retries=0) as good:
            assert good.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices
        assert httpx.get(f"{cluster.http_url}/health").status_code == 200
    finally:
        cluster.stop()


def test_sse_wire_format(cluster: StubCluster) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [p["choices"][0]["text"] for p in payloads] == [" w0", " w1"]
