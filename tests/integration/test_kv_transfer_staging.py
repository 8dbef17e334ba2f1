"""The TCP backend's host staging path (kv_transfer/staging.py), run end to end over loopback
with CPU pools forced to stage: the path a GPU pool always takes. Bytes must arrive as sent,
plain and int8 on the wire, and blocks that were not sent must stay as they were."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

from pdserve.kv_codec import dequantize_rows, quantize_rows
from pdserve.kv_transfer import (
    KVPoolLayout,
    TransferConfig,
    TransferState,
    make_receiver,
    make_sender,
)
from pdserve.kv_transfer.connector import KVReceiver
from pdserve.kv_transfer.peer_process import make_pool
from pdserve.kv_transfer.staging import stages_through_host

NUM_BLOCKS = 40  # more than two staging chunks of 16 blocks
TIMEOUT_S = 10.0
SRC = [3, 17, 5, 30, 0, *range(6, 16), 39, 21, 22, 23, 24, 25, 26, 27, 28, 29, 31, 32]
DST = [10, 2, 38, 7, 20, *range(24, 34), 0, 1, 3, 4, 5, 6, 8, 9, 11, 12, 13, 14]


def _layout(dtype: torch.dtype) -> KVPoolLayout:
    return KVPoolLayout(NUM_BLOCKS, 4, 4, 2, 8, dtype)  # layers 4, bs 4, 2 kv heads, dim 8


def _config(int8: bool = False) -> TransferConfig:
    return TransferConfig(timeout_s=TIMEOUT_S, int8=int8, stage_through_host=True)


@pytest.fixture
def receiver_pool(request: pytest.FixtureRequest) -> Iterator[tuple[KVReceiver, torch.Tensor]]:
    dtype = request.param
    receiver = make_receiver("tcp", _config(int8=True))
    pool = make_pool(_layout(dtype), seed=None)
    receiver.register_pool(pool)
    yield receiver, pool
    receiver.close()


def _send(receiver: KVReceiver, pool: torch.Tensor, int8: bool = False) -> None:
    sender = make_sender("tcp", _config(int8))
    sender.register_pool(pool)
    transfer_id = f"req-{uuid.uuid4().hex[:12]}"
    try:
        expected = receiver.expect(transfer_id, DST)
        sent = sender.send(transfer_id, SRC, receiver.connection_metadata(), DST)
        assert sent.wait(TIMEOUT_S) == TransferState.DONE, sent.error
        assert expected.wait(TIMEOUT_S) == TransferState.DONE, expected.error
    finally:
        sender.close()


def _untouched(pool: torch.Tensor) -> torch.Tensor:
    others = [b for b in range(NUM_BLOCKS) if b not in DST]
    return pool[others]


@pytest.mark.parametrize(
    "receiver_pool", [torch.float32, torch.bfloat16, torch.int8], indirect=True
)
def test_staged_blocks_arrive_byte_exact(receiver_pool: tuple[KVReceiver, torch.Tensor]) -> None:
    receiver, dst_pool = receiver_pool
    src_pool = make_pool(_layout(dst_pool.dtype), seed=7)
    _send(receiver, src_pool)
    assert torch.equal(dst_pool[DST].view(torch.uint8), src_pool[SRC].view(torch.uint8))
    assert not _untouched(dst_pool).view(torch.uint8).any()


@pytest.mark.parametrize("receiver_pool", [torch.float32], indirect=True)
def test_staged_int8_wire_and_conversion(receiver_pool: tuple[KVReceiver, torch.Tensor]) -> None:
    """int8 records (quantized from a staged float pool, dequantized into a staged one), and
    an int8 pool's blocks converted to the receiver's float format on the way."""
    receiver, dst_pool = receiver_pool
    src_pool = make_pool(_layout(torch.float32), seed=11)
    _send(receiver, src_pool, int8=True)
    want = dequantize_rows(quantize_rows(src_pool[SRC]), torch.float32)
    torch.testing.assert_close(dst_pool[DST], want, atol=0.05, rtol=0.05)
    int8_pool = make_pool(_layout(torch.int8), seed=13)
    _send(receiver, int8_pool)
    assert torch.equal(dst_pool[DST], dequantize_rows(int8_pool[SRC], torch.float32))
    assert not _untouched(dst_pool).any()


def test_staging_is_the_default_only_off_the_host() -> None:
    cpu_pool = torch.zeros(2, 1)
    assert not stages_through_host(cpu_pool, None)
    assert stages_through_host(cpu_pool, True)
    meta_pool = torch.zeros(2, 1, device="meta")  # stands for a pool in device memory
    assert stages_through_host(meta_pool, None)
    with pytest.raises(ValueError, match="must be staged"):
        stages_through_host(meta_pool, False)
