"""Mutual TLS for the worker gRPC API, from the cluster secret alone.

Every holder of the secret derives the same cluster CA (an ECDSA P-256 key from
``ClusterSecret.tls_ca_seed``, a self-signed certificate with fixed fields and a
deterministic signature), and issues itself a certificate under it with a fresh key when the
process starts. A worker serves only clients whose certificate that CA signed; a client
trusts only servers whose certificate it signed. So nothing has to be handed out besides the
secret, nothing secret crosses the wire, and a process without the secret fails the TLS
handshake before its first HTTP/2 frame is read: every service on the port (Worker, health,
reflection) is closed to it.

Why not TLS plus a bearer token: a token needs the same server certificates (the client must
know it talks to a member before it sends the token) and a check in every handler, and a
token leaks with one log line; a client certificate needs neither.

Every certificate names the same host, ``WORKER_TLS_NAME``, and clients check that name
(``grpc.ssl_target_name_override``) instead of the worker's IP address: addresses change with
hosts and NAT, and anyone with the secret could put any name in a certificate anyway. The
trust is "holds the secret", nothing finer.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.worker.cluster_secret import ClusterSecret

WORKER_TLS_NAME = "pdserve-worker"
# The order of the P-256 group: a private scalar must lie in [1, order - 1].
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_CA_NAME = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve cluster CA")])
_CA_VALID = (
    datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC),
    datetime.datetime(2125, 1, 1, tzinfo=datetime.UTC),
)
_CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=False,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)
_LEAF_DAYS = 3650  # a certificate lives as long as its process; no renewal to forget
_CLOCK_SKEW = datetime.timedelta(days=1)  # hosts whose clocks disagree still accept it


@dataclass(slots=True, frozen=True)
class ClientTls:
    """What a caller of workers needs: credentials and the name the workers' certificates carry."""

    credentials: grpc.ChannelCredentials
    options: tuple[tuple[str, str], ...] = (("grpc.ssl_target_name_override", WORKER_TLS_NAME),)


@dataclass(slots=True, frozen=True)
class _Identity:
    ca_pem: bytes
    key_pem: bytes
    cert_pem: bytes


def server_credentials(secret: ClusterSecret) -> grpc.ServerCredentials:
    """A worker's: its certificate, and only clients with one from the cluster CA."""
    ident = _identity(secret)
    return grpc.ssl_server_credentials(
        [(ident.key_pem, ident.cert_pem)], root_certificates=ident.ca_pem, require_client_auth=True
    )


def client_tls(secret: ClusterSecret) -> ClientTls:
    """A caller's (the router's): its certificate, and only servers with one from the CA."""
    ident = _identity(secret)
    credentials = grpc.ssl_channel_credentials(ident.ca_pem, ident.key_pem, ident.cert_pem)
    return ClientTls(credentials)


def worker_channel_factory(secret: ClusterSecret | None) -> Callable[[str], grpc.aio.Channel]:
    """How a worker calls another (a peer fetch): mutual TLS with a secret, else plaintext."""
    if secret is None:
        return grpc.aio.insecure_channel
    tls = client_tls(secret)
    return functools.partial(grpc.aio.secure_channel, credentials=tls.credentials,
                             options=tls.options)  # fmt: skip


def add_worker_port(server: grpc.aio.Server, address: str, secret: ClusterSecret | None) -> int:
    """Bind the worker's gRPC port: mutual TLS with a secret, plaintext without one."""
    if secret is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(secret))


@functools.cache
def _identity(secret: ClusterSecret) -> _Identity:
    """This process's certificate under the secret's CA (one per process and secret)."""
    ca_key = _ca_key(secret)
    ca_cert = _ca_certificate(ca_key)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, WORKER_TLS_NAME)]))
        .issuer_name(_CA_NAME)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=_LEAF_DAYS))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(WORKER_TLS_NAME)]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _Identity(_pem(ca_cert), _key_pem(key), _pem(cert))


def _ca_key(secret: ClusterSecret) -> ec.EllipticCurvePrivateKey:
    scalar = int.from_bytes(secret.tls_ca_seed(), "big") % (_P256_ORDER - 1) + 1
    return ec.derive_private_key(scalar, ec.SECP256R1())


def _ca_certificate(ca_key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    # Fixed fields and a deterministic signature (RFC 6979): every host derives the same bytes.
    public = ca_key.public_key()
    serial = int.from_bytes(hashlib.sha256(_public_der(public)).digest()[:16], "big") >> 1
    return (
        x509.CertificateBuilder()
        .subject_name(_CA_NAME)
        .issuer_name(_CA_NAME)
        .public_key(public)
        .serial_number(serial)
        .not_valid_before(_CA_VALID[0])
        .not_valid_after(_CA_VALID[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_KEY_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(ca_key, hashes.SHA256(), ecdsa_deterministic=True)
    )


def _public_der(public: ec.EllipticCurvePublicKey) -> bytes:
    return public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
