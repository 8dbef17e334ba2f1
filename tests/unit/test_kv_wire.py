"""Unit tests of the KV wire layout, pool layout and transfer handles (int8: test_kv_quant)."""

from __future__ import annotations

import struct
import sys
import zlib

import pytest
import torch

from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.connector import TransferHandle, TransferState
from pdserve.kv_transfer.expectations import ExpectationTable
from pdserve.kv_transfer.factory import make_sender
from pdserve.kv_transfer.layout import KVPoolLayout, check_block_ids, pool_bytes
from pdserve.kv_transfer.nixl_agent import load_nixl
from pdserve.kv_transfer.stats import TransferCounters
from pdserve.kv_transfer.wire import TransferHeader, WireFormatError, validate_header

LAYOUT = KVPoolLayout(32, 4, 4, 2, 8, torch.float32)  # blocks, layers, bs, kv heads, head_dim


def _header(**overrides: object) -> TransferHeader:
    fields: dict[str, object] = dict(
        transfer_id="req-7",
        dtype=torch.float32,
        block_size=4,
        num_layers=4,
        num_kv_heads=2,
        head_dim=8,
        dst_block_ids=(9, 2, 30),
        int8=False,
    )
    fields.update(overrides)
    return TransferHeader(**fields)  # type: ignore[arg-type]


# Pool layout ----------------------------------------------------------------------------


def test_layout_of_pool_reads_the_project_layout() -> None:
    pool = torch.zeros(32, 4, 2, 4, 2, 8, dtype=torch.bfloat16)
    layout = KVPoolLayout.of_pool(pool)
    assert layout == KVPoolLayout(32, 4, 4, 2, 8, torch.bfloat16)
    assert layout.block_bytes == 4 * 2 * 4 * 2 * 8 * 2


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        (torch.zeros(32, 4, 3, 4, 2, 8), "must have shape"),
        (torch.zeros(32, 4, 2, 4, 2), "must have shape"),
        (torch.zeros(32, 4, 2, 4, 8, 2).transpose(4, 5), "contiguous"),
        (torch.zeros(32, 4, 2, 4, 2, 8, dtype=torch.float64), "unsupported"),
    ],
)
def test_layout_rejects_pools_that_break_the_contract(pool: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVPoolLayout.of_pool(pool)


def test_pool_bytes_is_a_per_block_view_sharing_memory() -> None:
    pool = torch.randn(LAYOUT.pool_shape)
    view = pool_bytes(pool)
    assert view.shape == (32, LAYOUT.block_bytes)
    assert view[5].tobytes() == pool[5].numpy().tobytes()
    view[3][:] = 0
    assert torch.count_nonzero(pool[3]) == 0 and torch.count_nonzero(pool[4]) > 0


@pytest.mark.parametrize(
    ("ids", "message"),
    [([], "no block ids"), ([1, 32], r"out of range \[0, 32\)"), ([4, 4], "duplicate")],
)
def test_check_block_ids_names_the_problem(ids: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_block_ids(ids, 32, "source blocks")


# Wire header ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("int8", [False, True])
def test_header_round_trips(dtype: torch.dtype, int8: bool) -> None:
    header = _header(dtype=dtype, int8=int8)
    assert TransferHeader.decode(header.encode()) == header


def test_header_bytes_follow_the_documented_layout() -> None:
    # Built by hand from the table in wire.py, not by the encoder.
    tid = b"req-7"
    body = struct.pack("<4sHHBBHIIIII", b"PDKV", 2, 1, 2, 0, len(tid), 4, 4, 2, 8, 3)
    body += tid + struct.pack("<3I", 9, 2, 30)
    raw = body + struct.pack("<I", zlib.crc32(body))
    assert TransferHeader.decode(raw) == _header(dtype=torch.bfloat16, int8=True)
    assert _header(dtype=torch.bfloat16, int8=True).encode() == raw


# int8 record of LAYOUT, from quant.py's table: bf16 k_scales [L, H, D], bf16 v_scales
# [L, bs, H], int8 values [L, 2, bs, H, D] with L=4, bs=4, H=2, D=8.
ELEMS = 4 * 2 * 4 * 2 * 8
INT8_RECORD_BYTES = 2 * 4 * 2 * 8 + 2 * 4 * 4 * 2 + ELEMS


def test_record_sizes() -> None:
    assert _header().record_bytes() == ELEMS * 4
    assert _header(int8=True).record_bytes() == INT8_RECORD_BYTES
    assert _header(int8=True).payload_bytes() == 3 * INT8_RECORD_BYTES


def _corrupt(raw: bytes, offset: int, value: int) -> bytes:
    return raw[:offset] + bytes([value]) + raw[offset + 1 :]


def test_corrupt_headers_are_rejected_precisely() -> None:
    raw = _header().encode()
    with pytest.raises(WireFormatError, match="magic"):
        TransferHeader.decode(b"XXXX" + raw[4:])
    with pytest.raises(WireFormatError, match="unsupported wire version 9"):
        TransferHeader.decode(_corrupt(raw, 4, 9))
    with pytest.raises(WireFormatError, match="retired wire version 1, this receiver speaks 2"):
        TransferHeader.decode(_corrupt(raw, 4, 1))
    with pytest.raises(WireFormatError, match="crc32"):
        TransferHeader.decode(_corrupt(raw, len(raw) - 6, raw[-6] ^ 0xFF))
    with pytest.raises(WireFormatError, match="short frame"):
        TransferHeader.decode(raw[:20])
    with pytest.raises(WireFormatError, match="short frame"):
        TransferHeader.decode(raw[:-1])


def test_unknown_dtype_code_is_rejected_even_with_a_valid_checksum() -> None:
    body = bytearray(_header().encode()[:-4])
    body[8] = 77
    with pytest.raises(WireFormatError, match="unknown dtype code 77"):
        TransferHeader.decode(bytes(body) + struct.pack("<I", zlib.crc32(bytes(body))))


def test_validate_header_names_dtype_shape_and_block_mismatches() -> None:
    expected = (9, 2, 30)
    validate_header(_header(), LAYOUT, expected)  # matches: no error
    with pytest.raises(WireFormatError, match="dtype mismatch: sender sends bfloat16, receiver"):
        validate_header(_header(dtype=torch.bfloat16), LAYOUT, expected)
    with pytest.raises(WireFormatError, match=r"block shape mismatch.*\[4, 2, 4, 2, 16\]"):
        validate_header(_header(head_dim=16), LAYOUT, expected)
    with pytest.raises(WireFormatError, match="destination blocks"):
        validate_header(_header(dst_block_ids=(9, 2, 31)), LAYOUT, expected)


# Handles, expectations, config ----------------------------------------------------------


def test_handle_follows_the_state_machine() -> None:
    handle = TransferHandle("t")
    assert handle.wait(0.0) is TransferState.PENDING
    assert handle.start() and handle.succeed(123)
    assert not handle.fail("late") and handle.state is TransferState.DONE
    outcome = handle.outcome()
    assert outcome.history == (
        TransferState.PENDING,
        TransferState.TRANSFERRING,
        TransferState.DONE,
    )
    assert outcome.bytes_moved == 123 and outcome.error is None


def test_handle_refuses_to_skip_transferring() -> None:
    handle = TransferHandle("t")
    with pytest.raises(AssertionError, match="illegal transition PENDING -> DONE"):
        handle.succeed(1)
    assert handle.fail("peer gone") and handle.error == "peer gone"


def test_expectations_reject_reuse_and_overlap_then_time_out() -> None:
    table = ExpectationTable(timeout_s=0.05, counters=(counters := TransferCounters()))
    try:
        handle = table.add("a", (1, 2))
        with pytest.raises(ValueError, match="already expected"):
            table.add("a", (3,))
        with pytest.raises(ValueError, match=r"blocks \[2\] are already targets"):
            table.add("b", (2, 5))
        assert handle.wait(5.0) is TransferState.FAILED
        assert "timed out" in (handle.error or "")
        assert counters.snapshot().transfers_failed == 1
        with pytest.raises(ValueError, match="use a fresh id"):
            table.add("a", (1, 2))
        assert table.add("c", (1, 2)).state is TransferState.PENDING  # blocks were freed
    finally:
        table.close()


def test_expectation_table_close_fails_open_transfers() -> None:
    table = ExpectationTable(timeout_s=60.0, counters=TransferCounters())
    handle = table.add("a", (1,))
    table.close()  # long before the 60 s deadline
    assert handle.state is TransferState.FAILED and "closed" in (handle.error or "")


def test_config_requires_tcp_in_ucx_tls() -> None:
    with pytest.raises(ValueError, match="lacks 'tcp'"):
        TransferConfig(ucx_tls="sm,self")


def test_unknown_backend_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown KV transfer backend 'rdma'"):
        make_sender("rdma")


def test_missing_nixl_gives_an_actionable_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl", None)
    with pytest.raises(ImportError, match="pip install nixl"):
        load_nixl()
