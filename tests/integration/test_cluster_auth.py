"""`pdserve up` secured inside (its default: a cluster secret) and at the front door (API keys
and TLS, given as PDSERVE_* variables): real Ray, redis-server, worker actors with the real
model, KV over TCP, on loopback.

Without the secret a caller cannot use a worker (the TLS handshake refuses it: gRPC
UNAVAILABLE), push KV into a worker's pool (its connection is closed before the header is
read; nothing is received, no transfer fails, the reservation's real transfer then lands),
or read or write Redis (NOAUTH / WRONGPASS). With it, and with a key over TLS at the front
door, the answers equal the offline engine's. No secret shows in a log, a command line or
an environment.
"""

from __future__ import annotations

import re
import ssl
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import grpc
import httpx
import openai
import pytest
import redis

from pdserve.bench.up_process import descendants
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import worker_pb2
from pdserve.worker.cluster_secret import ClusterSecret, read_secret_file
from tests.integration.auth_probes import (
    prefill_then_decode,
    redis_replies,
    stats_error,
    worker_stub,
)
from tests.integration.certificates import self_signed_certificate
from tests.integration.cluster_proc import UpProcess, grpc_generate, start_up
from tests.integration.kv_auth_probe import push_without_the_secret
from tests.integration.worker_procs import greedy, offline_llm

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 12
API_KEY = f"sk-test-{uuid.uuid4().hex}"
PROMPT = "A library catalogue lists books by author, title and shelf. The atlases are kept on"


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    folder = tmp_path_factory.mktemp("cluster_auth")
    cert, key = self_signed_certificate(folder)
    keys = folder / "api-keys"
    keys.write_text(f"# keys of the test clients\n{API_KEY}\n")
    front_door = {
        "PDSERVE_API_KEYS_FILE": str(keys),
        "PDSERVE_TLS_CERT": str(cert),
        "PDSERVE_TLS_KEY": str(key),
    }
    args = ("--prefill", "1", "--decode", "1", "--kv-backend", "tcp")
    proc = start_up(folder, *args, env=front_door)
    try:
        offline_llm()  # load the reference while the cluster starts
        proc.wait_serving()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def secret(up: UpProcess) -> ClusterSecret:
    return read_secret_file(Path(up.state["secret_file"]))


@pytest.fixture(scope="module")
def workers(up: UpProcess) -> dict[str, str]:
    return {row["worker_id"]: row["address"] for row in up.status()["workers"]}


def _certificate(up: UpProcess) -> Path:
    return Path(up.log_path).parent / "cert.pem"


def _expected(prompt: str | list[int]) -> Any:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return offline_llm().generate([prompt], params)[0]


# -- the front door ---------------------------------------------------------------------


def test_openai_client_with_a_key_over_tls_gets_the_offline_answer(up: UpProcess) -> None:
    assert up.http_url.startswith("https://")
    verify = ssl.create_default_context(cafile=_certificate(up))
    with httpx.Client(verify=verify) as http:
        client = openai.OpenAI(
            base_url=up.http_url + "/v1", api_key=API_KEY, http_client=http, max_retries=0
        )
        got = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0
        )
    assert got.choices[0].text == _expected(PROMPT).text


def test_grpc_with_a_key_over_tls_runs_prefill_and_decode_on_the_secured_workers(
    up: UpProcess, secret: ClusterSecret, workers: dict[str, str]
) -> None:
    ids = offline_llm().tokenizer.encode(PROMPT)
    credentials = grpc.ssl_channel_credentials(_certificate(up).read_bytes())
    got = grpc_generate(up.grpc_address, ids, MAX_TOKENS, credentials=credentials, api_key=API_KEY)
    assert got.token_ids == _expected(ids).token_ids
    assert (got.prefill_worker, got.decode_worker) == ("prefill-0", "decode-0")
    with worker_stub(workers["decode-0"], secret) as decode:
        stats = decode.GetStats(worker_pb2.StatsRequest(), timeout=10)
    assert stats.transfers_ok >= 1 and stats.transfer_bytes > 0  # KV came over the handshake


def test_a_client_without_a_key_is_refused_at_the_front_door(up: UpProcess) -> None:
    verify = ssl.create_default_context(cafile=_certificate(up))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    url = f"{up.http_url}/v1/completions"
    assert httpx.post(url, json=body, verify=verify).status_code == 401
    wrong = {"Authorization": "Bearer sk-not-a-key"}
    assert httpx.post(url, json=body, headers=wrong, verify=verify).status_code == 401
    credentials = grpc.ssl_channel_credentials(_certificate(up).read_bytes())
    with pytest.raises(grpc.RpcError) as err:
        grpc_generate(up.grpc_address, [1, 2, 3], 2, credentials=credentials)
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(httpx.HTTPError):  # TLS only: plaintext HTTP gets no answer
        httpx.post(url.replace("https://", "http://"), json=body, timeout=5)


# -- the inside ------------------------------------------------------------------------


def test_a_caller_without_the_secret_cannot_use_a_worker(
    secret: ClusterSecret, workers: dict[str, str]
) -> None:
    assert set(workers) == {"prefill-0", "decode-0"}
    for address in workers.values():
        assert stats_error(address, secret)[0] is grpc.StatusCode.OK
        # The TLS handshake refuses it before any RPC: gRPC reports no connection.
        assert stats_error(address, None)[0] is grpc.StatusCode.UNAVAILABLE
        assert stats_error(address, ClusterSecret.generate())[0] is grpc.StatusCode.UNAVAILABLE


def test_a_kv_push_without_the_secret_lands_nothing_and_the_real_transfer_follows(
    secret: ClusterSecret, workers: dict[str, str]
) -> None:
    ids = offline_llm().tokenizer.encode(PROMPT)
    request_id = f"auth-{uuid.uuid4().hex[:8]}"
    with (
        worker_stub(workers["decode-0"], secret) as decode,
        worker_stub(workers["prefill-0"], secret) as prefill,
    ):
        reserve = decode.ReserveKV(
            worker_pb2.ReserveKVRequest(request_id=request_id, prompt_token_ids=ids), timeout=30
        )
        assert reserve.accepted
        dest = reserve.destination
        before = decode.GetStats(worker_pb2.StatsRequest(), timeout=10)
        push_without_the_secret(dest)
        after = decode.GetStats(worker_pb2.StatsRequest(), timeout=10)
        assert (after.transfer_bytes, after.transfers_ok, after.transfers_failed) == (
            before.transfer_bytes,
            before.transfers_ok,
            before.transfers_failed,
        )
        assert after.transfers_in_flight == before.transfers_in_flight  # still expected
        tokens = prefill_then_decode(prefill, decode, request_id, ids, dest, greedy(MAX_TOKENS))
    assert tokens == _expected(ids).token_ids


def test_redis_refuses_a_client_without_the_password(up: UpProcess) -> None:
    url = urlsplit(up.redis_url)
    assert url.password, "the embedded Redis runs with a password"
    probe = f"{up.state['key_prefix']}probe"
    read, write = f"GET {probe}", f"SET {probe} x"
    assert all(r.startswith("-NOAUTH ") for r in redis_replies(url, read, write))
    wrong = redis_replies(url, "AUTH not-the-password", read, write)
    assert wrong[0].startswith("-WRONGPASS ") and wrong[1].startswith("-NOAUTH "), wrong
    assert redis_replies(url, f"AUTH {unquote(url.password)}", write, read) == [
        "+OK",
        "+OK",
        "$1",  # a bulk string of one byte: "x"
    ]
    bare = urlunsplit(url._replace(netloc=f"{url.hostname}:{url.port}"))
    with pytest.raises(redis.AuthenticationError):  # what a redis-py client gets
        redis.Redis.from_url(bare, socket_timeout=5).get(probe)


def test_no_secret_in_a_log_a_command_line_or_an_environment(
    up: UpProcess, secret: ClusterSecret
) -> None:
    secrets = {
        "secret": secret.to_text().split(":", 1)[1],
        "redis password": secret.redis_password(),
        "ray token": secret.ray_token(),
        "kv key": secret.kv_transfer_key().hex(),
        "api key": API_KEY,
    }
    texts = {"pdserve up's log (with the workers')": Path(up.log_path).read_text()}
    processes = {up.process.pid: "pdserve up", **descendants(up.process.pid)}
    for pid, cmdline in processes.items():
        texts[f"command line of {pid} {cmdline[:60]}"] = _proc_text(pid, "cmdline")
        texts[f"environment of {pid} {cmdline[:60]}"] = _proc_text(pid, "environ")
    sessions = {m for c in processes.values() for m in re.findall(r"--session-dir=(\S+)", c)}
    assert sessions, "Ray's session directory, from its daemons' command lines"
    for log in (f for session in sessions for f in Path(session, "logs").rglob("*")):
        if log.is_file():
            texts[f"Ray's log {log}"] = log.read_text(errors="replace")
    for where, text in texts.items():
        for name, value in secrets.items():
            assert value not in text, f"the {name} is in the {where}"
    for path in (up.state_file, Path(up.state["secret_file"])):
        assert (path.stat().st_mode & 0o777) == 0o600, path


def _proc_text(pid: int, name: str) -> str:
    try:
        return (Path("/proc") / str(pid) / name).read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""  # exited meanwhile


def test_stopping_removes_the_generated_secret(up: UpProcess) -> None:
    secret_file = Path(up.state["secret_file"])
    token_file = Path(up.state_file).with_suffix(".ray-token")
    assert secret_file.exists() and token_file.exists()
    assert up.stop() == 0, up.tail()
    assert not secret_file.exists() and not token_file.exists()
