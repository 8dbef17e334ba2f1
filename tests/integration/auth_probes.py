"""What a caller without the cluster secret tries, and how each attempt is refused; and the
real transfer a member then makes into the same reservation. A KV push: kv_auth_probe.py.

Shared by the single-host auth tests (test_cluster_auth.py, in the test process) and the
multi-host ones (test_multi_host.py, from a host of its own: ``python -m
tests.integration.netns_outsider``).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from urllib.parse import SplitResult

import grpc

from pdserve.proto import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker.cluster_secret import ClusterSecret
from pdserve.worker.mutual_tls import client_tls


@contextlib.contextmanager
def worker_stub(address: str, secret: ClusterSecret | None) -> Iterator[worker_pb2_grpc.WorkerStub]:
    """A Worker stub as a member (the secret's certificate) or as an outsider (plaintext)."""
    if secret is None:
        channel = grpc.insecure_channel(address)
    else:
        tls = client_tls(secret)
        channel = grpc.secure_channel(address, tls.credentials, options=list(tls.options))
    with channel:
        yield worker_pb2_grpc.WorkerStub(channel)


def stats_error(address: str, secret: ClusterSecret | None) -> tuple[grpc.StatusCode, str]:
    """GetStats' status code and details (OK, "" when it answered)."""
    with worker_stub(address, secret) as stub:
        try:
            stub.GetStats(worker_pb2.StatsRequest(), timeout=10)
        except grpc.RpcError as err:
            return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def prefill_then_decode(
    prefill: worker_pb2_grpc.WorkerStub,
    decode: worker_pb2_grpc.WorkerStub,
    request_id: str,
    ids: list[int],
    dest: worker_pb2.KVDestination,
    params: common_pb2.SamplingParams,
) -> list[int]:
    """The router's steps after ReserveKV, as a member: the real KV transfer, then decode."""
    events = prefill.Prefill(
        worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=ids, params=params, destination=dest
        ),
        timeout=120,
    )
    first = next(events).first_token
    report = next(events).transfer
    assert report.ok, report.error
    tokens = list(first.token_ids)
    decode_request = worker_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=ids, params=params, first_token=first
    )
    for chunk in decode.Decode(decode_request, timeout=120):
        tokens += chunk.token_ids
    return tokens


def redis_replies(url: SplitResult, *commands: str) -> list[str]:
    """The first line of the server's reply to each inline command, on one connection."""
    address = (url.hostname or "", url.port or 0)
    with socket.create_connection(address, timeout=5) as sock, sock.makefile("rb") as replies:
        sock.sendall("".join(f"{command}\r\n" for command in commands).encode())
        return [replies.readline().decode().strip() for _ in commands]
