"""Two KV endpoints on one small pool layout, for the transfer authentication tests: a
receiver and senders of either backend, keyed or not, and what a member's transfer must
land (the sender's blocks ``SRC`` byte for byte in the receiver's ``DST``)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import torch

from pdserve.kv_transfer import (
    KVPoolLayout,
    TransferConfig,
    TransferState,
    make_receiver,
    make_sender,
)
from pdserve.kv_transfer.connector import KVReceiver, KVSender, TransferHandle
from pdserve.kv_transfer.peer_process import make_pool

LAYOUT = KVPoolLayout(16, 4, 4, 2, 8, torch.float32)
SRC, DST = [0, 3, 5, 7], [9, 2, 14, 11]
KEY, WRONG_KEY = b"cluster-kv-key-A" * 2, b"cluster-kv-key-B" * 2
TIMEOUT_S = 10.0


def kv_config(key: bytes | None) -> TransferConfig:
    return TransferConfig(timeout_s=TIMEOUT_S, io_timeout_s=2.0, auth_key=key)


def kv_sender(key: bytes | None, backend: str = "tcp") -> KVSender:
    sender = make_sender(backend, kv_config(key))
    sender.register_pool(make_pool(LAYOUT, seed=7))
    return sender


@contextlib.contextmanager
def kv_receiver(backend: str, key: bytes | None) -> Iterator[tuple[KVReceiver, torch.Tensor]]:
    endpoint = make_receiver(backend, kv_config(key))
    pool = make_pool(LAYOUT, seed=3)
    endpoint.register_pool(pool)
    try:
        yield endpoint, pool
    finally:
        endpoint.close()


def transfer_id() -> str:
    return f"req-{uuid.uuid4().hex[:12]}"


def assert_member_lands(
    member: KVSender, endpoint: KVReceiver, pool: torch.Tensor, tid: str, expected: TransferHandle
) -> None:
    """``member`` sends SRC into DST for ``tid``; both ends report DONE and the bytes are
    the sender's."""
    handle = member.send(tid, SRC, endpoint.connection_metadata(), DST)
    assert handle.wait(TIMEOUT_S) is TransferState.DONE, handle.error
    assert expected.wait(TIMEOUT_S) is TransferState.DONE, expected.error
    assert torch.equal(pool[DST], make_pool(LAYOUT, seed=7)[SRC])
