"""A KV push into a reserved destination by a caller without the cluster secret: each way it
tries is refused. Apart from auth_probes.py because it loads torch, which the other probes'
processes (tests/integration/netns_outsider.py) do without.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from dataclasses import replace

import pytest

from pdserve.kv_transfer import (
    KVPoolLayout,
    KVSender,
    TransferConfig,
    TransferHeader,
    TransferState,
    make_sender,
)
from pdserve.kv_transfer.metadata import decode_peer
from pdserve.kv_transfer.peer_process import make_pool
from pdserve.proto import worker_pb2
from pdserve.worker.cluster_secret import ClusterSecret


def push_without_the_secret(dest: worker_pb2.KVDestination) -> None:
    """Outsiders try to write the reserved blocks: with another cluster's key, with none
    (refused by the receiver's metadata before connecting), and as a raw header."""
    peer = decode_peer(dest.agent_metadata, "tcp")
    assert peer.auth
    layout = replace(peer.layout, num_blocks=len(dest.block_ids))
    src = list(range(len(dest.block_ids)))
    with _outsider(layout, ClusterSecret.generate().kv_transfer_key()) as other_cluster:
        handle = other_cluster.send(dest.transfer_id, src, dest.agent_metadata, dest.block_ids)
        assert handle.wait(10) is TransferState.FAILED
        assert "closed the connection during the KV handshake" in (handle.error or "")
    with _outsider(layout, None) as keyless, pytest.raises(ValueError, match="requires auth"):
        keyless.send(dest.transfer_id, src, dest.agent_metadata, dest.block_ids)
    header = TransferHeader.for_layout(layout, dest.transfer_id, tuple(dest.block_ids), False)
    with socket.create_connection((peer.fields["host"], peer.fields["port"]), timeout=10) as sock:
        assert sock.recv(64).startswith(b"PDKA")  # a challenge: the receiver reads no header
        sock.sendall(header.encode())
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(1024) == b""  # closed without an answer


@contextlib.contextmanager
def _outsider(layout: KVPoolLayout, key: bytes | None) -> Iterator[KVSender]:
    sender = make_sender("tcp", TransferConfig(timeout_s=10, auth_key=key))
    sender.register_pool(make_pool(layout, seed=5))
    try:
        yield sender
    finally:
        sender.close()
