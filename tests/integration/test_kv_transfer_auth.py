"""TCP KV transfer with a cluster key: real sockets on loopback, real pools.

A sender that cannot prove the key is cut off before the receiver reads its header: the
receiver's pool keeps every byte, the expectation stays open for the real sender, and the
refusal is counted. NIXL has no connection to authenticate; its notices carry a MAC under
the key instead (test_kv_transfer_nixl_auth.py). What both backends share is run on both
here: a member's transfer, and ends that disagree about the key.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch

from pdserve.kv_transfer import TransferHeader, TransferState
from pdserve.kv_transfer.connector import KVReceiver
from pdserve.kv_transfer.metadata import decode_peer
from tests.integration.kv_endpoints import (
    DST,
    KEY,
    LAYOUT,
    SRC,
    TIMEOUT_S,
    WRONG_KEY,
    assert_member_lands,
    kv_receiver,
    kv_sender,
    transfer_id,
)

BACKENDS = ("tcp", "nixl")


@pytest.fixture()
def receiver() -> Iterator[tuple[KVReceiver, torch.Tensor]]:
    with kv_receiver("tcp", KEY) as built:
        yield built


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sender_with_the_key_moves_blocks_byte_exact(backend: str) -> None:
    with kv_receiver(backend, KEY) as (endpoint, pool):
        assert decode_peer(endpoint.connection_metadata(), backend).auth
        sender = kv_sender(KEY, backend)
        try:
            tid = transfer_id()
            assert_member_lands(sender, endpoint, pool, tid, endpoint.expect(tid, DST))
            assert endpoint.stats().auth_refused == 0
        finally:
            sender.close()


def test_a_sender_with_another_key_lands_no_block_and_spoils_nothing(
    receiver: tuple[KVReceiver, torch.Tensor],
) -> None:
    endpoint, pool = receiver
    before = pool.clone()
    intruder, member = kv_sender(WRONG_KEY), kv_sender(KEY)
    try:
        tid = transfer_id()
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
        assert_member_lands(member, endpoint, pool, tid, expected)
    finally:
        intruder.close()
        member.close()


def test_a_raw_connection_sending_a_header_is_closed_unanswered(
    receiver: tuple[KVReceiver, torch.Tensor],
) -> None:
    """What a keyless sender that ignores the metadata does: its header at once."""
    endpoint, pool = receiver
    before = pool.clone()
    tid = transfer_id()
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
    keyless, keyed = kv_sender(None, backend), kv_sender(KEY, backend)
    with kv_receiver(backend, KEY) as (endpoint, _), kv_receiver(backend, None) as (open_end, _):
        try:
            with pytest.raises(ValueError, match="requires authenticated connections"):
                keyless.send(transfer_id(), SRC, endpoint.connection_metadata(), DST)
            with pytest.raises(ValueError, match="the receiver does not"):
                keyed.send(transfer_id(), SRC, open_end.connection_metadata(), DST)
        finally:
            keyless.close()
            keyed.close()
