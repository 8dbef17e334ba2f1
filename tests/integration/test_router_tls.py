"""The router's gRPC and HTTP servers over TLS, with a throwaway self-signed certificate."""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.proto import inference_pb2, inference_pb2_grpc
from pdserve.router.config import RouterConfig
from tests.integration.certificates import self_signed_certificate
from tests.integration.stub_worker import start_stub_cluster


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


def test_grpc_and_http_over_tls(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    config = RouterConfig(tls_cert_path=str(cert), tls_key_path=str(key))
    cluster = start_stub_cluster({"w0": "colocated"}, config)
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(cluster.grpc_address, credentials) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            assert stub.ListModels(inference_pb2.ListModelsRequest(), timeout=5).models
        with grpc.insecure_channel(cluster.grpc_address) as plain:
            stub = inference_pb2_grpc.InferenceStub(plain)
            with pytest.raises(grpc.RpcError):
                stub.ListModels(inference_pb2.ListModelsRequest(), timeout=2)
        https = cluster.http_url.replace("http://", "https://")
        response = httpx.get(f"{https}/v1/models", verify=ssl.create_default_context(cafile=cert))
        assert response.status_code == 200
        assert response.json()["data"][0]["id"] == "fake-model"
    finally:
        cluster.stop()
