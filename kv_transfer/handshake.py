"""Mutual authentication of a TCP KV connection, before the header or any block is read.

Both ends hold one key (``TransferConfig.auth_key``, derived from the cluster secret). Right
after accept::

    receiver -> sender    "PDKA" | version u8 | receiver nonce (32 bytes)
    sender   -> receiver  sender nonce (32) | HMAC-SHA256(key, "sender" | both nonces)
    receiver              a wrong or short answer: close the connection, read nothing more
    receiver -> sender    HMAC-SHA256(key, "receiver" | both nonces)
    sender                checks it: it writes to a member, not to whoever took the port

Fresh nonces on both sides make every proof new (a recorded handshake cannot be replayed)
and the role in the MAC stops a proof from being reflected back. This authenticates the
peers, not the bytes after it: blocks travel unencrypted and without a MAC (the header's CRC
catches accidents, not an attacker on the path), as they do over NIXL.

NIXL has no connection to run this on: a sender can write into a pool only with the
receiver's agent metadata, which travels only inside the worker gRPC API (mutual TLS in a
cluster with a secret): ReserveKV's ``KVDestination`` to the router, then the router's
Prefill request; and a transfer completes only on a notice that carries a MAC under the
same key (notice_mac.py).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct

from pdserve.kv_transfer.sockets import recv_exact, send_all

AUTH_SCHEME = "hmac-sha256-v1"  # what a receiver's connection metadata says it requires
_VERSION = 1
_CHALLENGE = struct.Struct("<4sB32s")
_MAGIC = b"PDKA"
_NONCE_BYTES = 32
_MAC_BYTES = 32


class HandshakeRefused(ConnectionError):
    """The other end did not prove that it holds the key."""


def check_auth_settings(receiver_requires_auth: bool, sender_key: bytes | None) -> None:
    """Sender side, before connecting: both ends must agree on authentication (ValueError)."""
    if receiver_requires_auth and sender_key is None:
        raise ValueError(
            "the KV receiver requires authenticated connections (a cluster secret) and this "
            "sender has no key; give both workers the same --cluster-secret-file"
        )
    if not receiver_requires_auth and sender_key is not None:
        raise ValueError(
            "this sender authenticates KV connections (cluster secret) but the receiver does "
            "not: it is outside the cluster, or runs without --cluster-secret-file"
        )


def sender_proof(key: bytes, receiver_nonce: bytes, sender_nonce: bytes) -> bytes:
    return _mac(key, b"sender", receiver_nonce, sender_nonce)


def receiver_proof(key: bytes, receiver_nonce: bytes, sender_nonce: bytes) -> bytes:
    return _mac(key, b"receiver", receiver_nonce, sender_nonce)


def authenticate_sender(
    conn: socket.socket, key: bytes, deadline_s: float, io_timeout_s: float
) -> None:
    """Receiver side: challenge the sender; HandshakeRefused (or OSError) unless it proves
    the key. The caller closes the connection on any error."""
    receiver_nonce = secrets.token_bytes(_NONCE_BYTES)
    send_all(conn, _CHALLENGE.pack(_MAGIC, _VERSION, receiver_nonce), deadline_s, io_timeout_s)
    answer = recv_exact(conn, _NONCE_BYTES + _MAC_BYTES, deadline_s, io_timeout_s)
    sender_nonce, proof = answer[:_NONCE_BYTES], answer[_NONCE_BYTES:]
    if not hmac.compare_digest(proof, sender_proof(key, receiver_nonce, sender_nonce)):
        raise HandshakeRefused("the sender did not prove the cluster's KV key")
    send_all(conn, receiver_proof(key, receiver_nonce, sender_nonce), deadline_s, io_timeout_s)


def authenticate_receiver(
    sock: socket.socket, key: bytes, deadline_s: float, io_timeout_s: float
) -> None:
    """Sender side: answer the receiver's challenge and check its proof."""
    try:
        magic, version, receiver_nonce = _CHALLENGE.unpack(
            recv_exact(sock, _CHALLENGE.size, deadline_s, io_timeout_s)
        )
    except ConnectionError as err:
        raise HandshakeRefused(f"the receiver sent no KV handshake challenge ({err})") from err
    if magic != _MAGIC or version != _VERSION:
        raise HandshakeRefused(f"not a KV handshake challenge: {magic!r} version {version}")
    sender_nonce = secrets.token_bytes(_NONCE_BYTES)
    proof = sender_proof(key, receiver_nonce, sender_nonce)
    send_all(sock, sender_nonce + proof, deadline_s, io_timeout_s)
    try:
        answer = recv_exact(sock, _MAC_BYTES, deadline_s, io_timeout_s)
    except ConnectionError as err:
        raise HandshakeRefused(
            "the receiver closed the connection during the KV handshake: its cluster secret "
            "is not this sender's"
        ) from err
    if not hmac.compare_digest(answer, receiver_proof(key, receiver_nonce, sender_nonce)):
        raise HandshakeRefused("the receiver did not prove the cluster's KV key")


def _mac(key: bytes, role: bytes, receiver_nonce: bytes, sender_nonce: bytes) -> bytes:
    message = b"pdserve-kv-handshake/" + role + receiver_nonce + sender_nonce
    return hmac.new(key, message, hashlib.sha256).digest()
