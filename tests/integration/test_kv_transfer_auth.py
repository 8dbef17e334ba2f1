"""TCP KV transfer with a cluster key: real sockets on loopback, real pools.

A sender that cannot prove the key is cut off before the receiver reads its header: the
receiver's pool keeps every byte, the expectation stays open for the real sender, and the
refusal is counted. NIXL has no connection to authenticate; its notices carry a MAC under
the key instead (test_kv_transfer_nixl_auth.py). What both backends share is run on both
here: a member's transfer, and ends that disagree about the key.
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from pdserve.kv_transfer import (
    KVPoolLayout,
    TransferConfig,
    TransferHeader,
    TransferState,
    make_receiver,
    make_sender,
)
from pdserve.kv_transfer.connector import KVReceiver, KVSender
from pdserve.kv_transfer.metadata import decode_peer
from pdserve.kv_transfer.peer_process import make_pool

LAYOUT = KVPoolLayout(16, 4, 4, 2, 8, torch.float32)
SRC, DST = [0, 3, 5, 7], [9, 2, 14, 11]
KEY, WRONG_KEY = b"cluster-kv-key-A" * 2, b"cluster-kv-key-B" * 2
TIMEOUT_S = 10.0
BACKENDS = ("tcp", "nixl")


def _config(key: bytes | None) -> TransferConfig:
    return TransferConfig(timeout_s=TIMEOUT_S, io_timeout_s=2.0, auth_key=key)


def _sender(key: bytes | None, backend: str = "tcp") -> KVSender:
    sender = make_sender(backend, _config(key))
    sender.register_pool(make_pool(LAYOUT, seed=7))
    return sender


@contextlib.contextmanager
def _receiver(backend: str, key: bytes | None) -> Iterator[tuple[KVReceiver, torch.Tensor]]:
    endpoint = make_receiver(backend, _config(key))
    pool = make_pool(LAYOUT, seed=3)
    endpoint.register_pool(pool)
    try:
        yield endpoint, pool
    finally:
        endpoint.close()


@pytest.fixture()
def receiver() -> Iterator[tuple[KVReceiver, torch.Tensor]]:
    with _receiver("tcp", KEY) as built:
        yield built


def _tid() -> str:
    return f"req-{uuid.uuid4().hex[:12]}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sender_with_the_key_moves_blocks_byte_exact(backend: str) -> None:
    with _receiver(backend, KEY) as (endpoint, pool):
        assert decode_peer(endpoint.connection_metadata(), backend).auth
        sender = _sender(KEY, backend)
        try:
            tid = _tid()
            done = endpoint.expect(tid, DST)
            handle = sender.send(tid, SRC, endpoint.connection_metadata(), DST)
            assert handle.wait(TIMEOUT_S) is TransferState.DONE, handle.error
            assert done.wait(TIMEOUT_S) is TransferState.DONE, done.error
            assert torch.equal(pool[DST], make_pool(LAYOUT, seed=7)[SRC])
            assert endpoint.stats().auth_refused == 0
        finally:
            sender.close()


def test_a_sender_with_another_key_lands_no_block_and_spoils_nothing(
    receiver: tuple[KVReceiver, torch.Tensor],
) -> None:
    endpoint, pool = receiver
    before = pool.clone()
    intruder, member = _sender(WRONG_KEY), _sender(KEY)
    try:
        tid = _tid()
        expected = endpoint.expect(tid, DST)
        refused = intruder.send(tid, SRC, endpoint.connection_metadata(), DST)
        assert refused.wait(TIMEOUT_S) is TransferState.FAILED
        assert "closed the connection during the KV handshake" in (refused.error or "")
        assert torch.equal(pool, before)  # every byte of the pool untouched
        assert expected.state is TransferState.PENDING  # the real transfer may still come
        stats = endpoint.stats()
        assert (stats.auth_refused, stats.transfers_failed, stats.bytes_received) == (
            1,
            0,
            0,
        )
        handle = member.send(tid, SRC, endpoint.connection_metadata(), DST)
        assert handle.wait(TIMEOUT_S) is TransferState.DONE, handle.error
        assert expected.wait(TIMEOUT_S) is TransferState.DONE
    finally:
        intruder.close()
        member.close()


def test_a_raw_connection_sending_a_header_is_closed_unanswered(
    receiver: tuple[KVReceiver, torch.Tensor],
) -> None:
    """What a keyless sender that ignores the metadata does: its header at once."""
    endpoint, pool = receiver
    before = pool.clone()
    tid = _tid()
    expected = endpoint.expect(tid, DST)
    peer = decode_peer(endpoint.connection_metadata(), "tcp")
    assert peer.auth
    header = TransferHeader.for_layout(LAYOUT, tid, tuple(DST), int8=False).encode()
    with socket.create_connection((peer.fields["host"], peer.fields["port"]), timeout=5) as sock:
        assert sock.recv(64).startswith(b"PDKA")  # the receiver speaks first: a challenge
        sock.sendall(header)
        assert _answer(sock) == b""  # closed without an ack: no header was parsed
    deadline = time.monotonic() + 5
    while endpoint.stats().auth_refused < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert endpoint.stats().auth_refused == 1
    assert torch.equal(pool, before)
    assert expected.state is TransferState.PENDING


def _answer(sock: socket.socket) -> bytes:
    """What the receiver sends before it closes (a reset counts as closed)."""
    try:
        return sock.recv(1024)
    except ConnectionResetError:
        return b""


@pytest.mark.parametrize("backend", BACKENDS)
def test_senders_and_receivers_that_disagree_fail_before_connecting(backend: str) -> None:
    keyless, keyed = _sender(None, backend), _sender(KEY, backend)
    with _receiver(backend, KEY) as (endpoint, _), _receiver(backend, None) as (open_end, _):
        try:
            with pytest.raises(ValueError, match="requires authenticated connections"):
                keyless.send(_tid(), SRC, endpoint.connection_metadata(), DST)
            with pytest.raises(ValueError, match="the receiver does not"):
                keyed.send(_tid(), SRC, open_end.connection_metadata(), DST)
        finally:
            keyless.close()
            keyed.close()
