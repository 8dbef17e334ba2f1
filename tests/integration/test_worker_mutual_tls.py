"""Worker gRPC under the cluster secret: real grpc.aio servers (stub workers, no model) with
mutual TLS, and a real router that calls them with its own certificate.

The refusal is the TLS handshake itself: a worker asks every client for a certificate the
cluster CA signed, so a caller without the secret never gets to send an HTTP/2 frame. gRPC
reports that as UNAVAILABLE (no connection could be made), for the Worker service and for
health alike; the raw TLS test shows the server closing the connection before sending a
single byte of HTTP/2.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.worker.cluster_secret import ClusterSecret
from pdserve.worker.mutual_tls import client_tls
from tests.integration.cluster_proc import grpc_generate
from tests.integration.stub_worker import StubCluster, start_stub_cluster

SECRET = ClusterSecret.generate()


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[StubCluster, dict[str, str]]]:
    stubs = start_stub_cluster({"p0": "prefill", "d0": "decode"}, secret=SECRET)
    addresses = {info.worker_id: info.address for info in stubs.lifecycle.directory.live_workers()}
    yield stubs, addresses
    stubs.stop()


def _get_stats(address: str, channel: grpc.Channel) -> grpc.StatusCode:
    try:
        worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.StatsRequest(), timeout=5)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def _member_channel(address: str, secret: ClusterSecret) -> grpc.Channel:
    tls = client_tls(secret)
    return grpc.secure_channel(address, tls.credentials, options=list(tls.options))


def test_the_router_reaches_its_workers_over_mutual_tls(
    cluster: tuple[StubCluster, dict[str, str]],
) -> None:
    stubs, _ = cluster
    got = grpc_generate(stubs.grpc_address, [1, 2, 3], 4)
    assert (got.prefill_worker, got.decode_worker, len(got.token_ids)) == ("p0", "d0", 4)
    assert [method for method, _ in stubs.workers["p0"].record.calls] == ["Prefill"]
    assert [method for method, _ in stubs.workers["d0"].record.calls] == ["ReserveKV", "Decode"]


def test_a_member_is_served_and_a_caller_without_the_secret_is_not(
    cluster: tuple[StubCluster, dict[str, str]],
) -> None:
    _, addresses = cluster
    address = addresses["d0"]
    with _member_channel(address, SECRET) as member:
        assert _get_stats(address, member) is grpc.StatusCode.OK
    with grpc.insecure_channel(address) as plaintext:
        assert _get_stats(address, plaintext) is grpc.StatusCode.UNAVAILABLE
    no_certificate = grpc.ssl_channel_credentials()  # TLS, trusting the usual CAs, no client cert
    options = [("grpc.ssl_target_name_override", "pdserve-worker")]
    with grpc.secure_channel(address, no_certificate, options=options) as anonymous:
        assert _get_stats(address, anonymous) is grpc.StatusCode.UNAVAILABLE
    with _member_channel(address, ClusterSecret.generate()) as other_cluster:
        assert _get_stats(address, other_cluster) is grpc.StatusCode.UNAVAILABLE


def test_health_is_closed_to_callers_without_the_secret_too(
    cluster: tuple[StubCluster, dict[str, str]],
) -> None:
    _, addresses = cluster
    request = health_pb2.HealthCheckRequest()
    with _member_channel(addresses["p0"], SECRET) as member:
        reply = health_pb2_grpc.HealthStub(member).Check(request, timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(addresses["p0"]) as plaintext:
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(plaintext).Check(request, timeout=5)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE


def test_without_a_client_certificate_the_server_closes_before_any_http2_byte(
    cluster: tuple[StubCluster, dict[str, str]],
) -> None:
    _, addresses = cluster
    host, port = addresses["d0"].rsplit(":", 1)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # an attacker's client
    context.set_alpn_protocols(["h2"])
    raw = socket.create_connection((host, int(port)), timeout=5)
    with context.wrap_socket(raw) as tls:
        assert tls.version() == "TLSv1.3"
        assert tls.getpeercert(binary_form=True)  # the worker did present its certificate
        try:
            first = tls.recv(1024)
        except (ssl.SSLError, ConnectionResetError):
            first = b""
    # A served client's first bytes would be the server's HTTP/2 SETTINGS frame.
    assert first == b""
