"""`pdserve up` as a real child process for the cluster tests, and ways to talk to it.

The launcher is the benchmarks' (``bench/up_process.py``): ``python -m pdserve.cluster.cli up`` from
the repository root, with PR_SET_PDEATHSIG and a state file of endpoints once serving. Here
``stop`` does not kill stragglers (``kill_leftovers=False``), so ``descendants`` and ``alive``
can show that SIGTERM alone leaves no orphan behind (Redis, Ray's daemons, worker actors).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import redis

from pdserve.bench import up_process
from pdserve.bench.up_process import UpProcess, alive, descendants
from pdserve.proto import common_pb2, inference_pb2, inference_pb2_grpc

# Small KV pools: several workers share this machine's memory with other test jobs.
TEST_ARGS = ("--num-blocks", "256")
TEST_ENV = {"PDSERVE_TORCH_THREADS": "1"}


def start_up(
    tmp_dir: Path, *args: str, env: Mapping[str, str] | None = None, new_session: bool = False
) -> UpProcess:
    """Launch `pdserve up` (not waiting: workers load while the caller does other work);
    ``env`` adds variables to the test ones."""
    child_env = {**TEST_ENV, **(env or {})}
    return up_process.start_up(
        tmp_dir, (*TEST_ARGS, *args), child_env, kill_leftovers=False, new_session=new_session
    )


@dataclass(frozen=True)
class GrpcResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    prefill_worker: str
    decode_worker: str


def grpc_generate(
    address: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    policy: str = "",
    timeout_s: float = 120.0,
    ignore_eos: bool = False,
    credentials: grpc.ChannelCredentials | None = None,
    api_key: str | None = None,
) -> GrpcResult:
    """Greedy generation through the router's gRPC API, from token ids (over TLS with
    ``credentials``, sending ``api_key`` as a bearer token when given)."""
    params = common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos
    )
    request = inference_pb2.GenerateTextRequest(
        token_ids=inference_pb2.TokenIds(ids=list(prompt_token_ids)),
        params=params,
        routing_policy=policy,
    )
    token_ids: list[int] = []
    text, finish, prefill, decode = "", "", "", ""
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for response in stub.Generate(request, timeout=timeout_s, metadata=metadata):
            token_ids += response.chunk.token_ids
            text += response.chunk.text
            finish = response.chunk.finish_reason or finish
            prefill = response.prefill_worker or prefill
            decode = response.decode_worker or decode
    return GrpcResult(token_ids, text, finish, prefill, decode)


def redis_client(up: UpProcess) -> redis.Redis:
    return redis.Redis.from_url(up.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return
        except (redis.RedisError, OSError):
            pass  # the thing we wait for may be restarting
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


__all__ = [
    "GrpcResult",
    "UpProcess",
    "alive",
    "descendants",
    "grpc_generate",
    "redis_client",
    "start_up",
    "wait_until",
]
