"""One conformance suite for every KV transfer backend: nixl, tcp, inproc.

For nixl and tcp the receiver runs in a spawned child process and the sender in the test
process, so bytes really cross a process boundary (NIXL over UCX, TCP over loopback). The
receiver process holds fp32, bf16 and int8 pools (an int8 pool: int8 rows with a scale each).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import torch

from pdserve.kv_codec import dequantize_rows, quantize_rows
from pdserve.kv_transfer import (
    BACKENDS,
    KVPoolLayout,
    KVReceiver,
    KVSender,
    TransferConfig,
    TransferState,
    make_receiver,
    make_sender,
)
from pdserve.kv_transfer.connector import TransferOutcome
from pdserve.kv_transfer.peer_process import EndpointSpec, LocalPeer, PeerProcess, make_pool

DTYPES = (torch.float32, torch.bfloat16)
SLOT = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # receiver endpoint per pool dtype
NUM_BLOCKS = 32
TIMEOUT_S = 10.0
FULL_PATH = (TransferState.PENDING, TransferState.TRANSFERRING, TransferState.DONE)

Peer = LocalPeer | PeerProcess


def _layout(dtype: torch.dtype, head_dim: int = 8) -> KVPoolLayout:
    return KVPoolLayout(NUM_BLOCKS, 4, 4, 2, head_dim, dtype)  # layers 4, bs 4, 2 kv heads


@pytest.fixture(scope="module", params=BACKENDS)
def receiver_peer(request: pytest.FixtureRequest) -> Iterator[tuple[str, Peer]]:
    backend = str(request.param)
    config = TransferConfig(timeout_s=TIMEOUT_S, int8=True)
    specs = [EndpointSpec(backend, "receiver", _layout(dt), config) for dt in SLOT]
    peer: Peer = LocalPeer(specs) if backend == "inproc" else PeerProcess(specs)
    yield backend, peer
    peer.close()


def _sender(
    backend: str, dtype: torch.dtype, int8: bool = False, seed: int = 1
) -> tuple[KVSender, torch.Tensor]:
    sender = make_sender(backend, TransferConfig(timeout_s=TIMEOUT_S, int8=int8))
    pool = make_pool(_layout(dtype), seed)
    sender.register_pool(pool)
    return sender, pool


def _tid() -> str:
    return f"req-{uuid.uuid4().hex[:12]}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_blocks_arrive_byte_exact(receiver_peer: tuple[str, Peer], dtype: torch.dtype) -> None:
    backend, peer = receiver_peer
    slot, layout = SLOT[dtype], _layout(dtype)
    sender, pool = _sender(backend, dtype)
    src, dst = [3, 17, 5, 30, 0], [10, 2, 31, 7, 20]
    before, stats_before = peer.blocks(slot, range(NUM_BLOCKS)), peer.stats(slot)
    tid = _tid()
    try:
        peer.expect(slot, tid, dst)
        handle = sender.send(tid, src, peer.metadata[slot], dst)
        assert handle.wait(TIMEOUT_S) is TransferState.DONE, handle.error
        received = peer.wait(tid, TIMEOUT_S)
        sent_stats = sender.stats()
    finally:
        sender.close()
    after = peer.blocks(slot, range(NUM_BLOCKS))
    assert torch.equal(_bytes(after[dst]), _bytes(pool[src]))
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
    assert torch.equal(_bytes(after[untouched]), _bytes(before[untouched]))
    payload = len(src) * layout.block_bytes
    assert handle.outcome().history == FULL_PATH and received.history == FULL_PATH
    assert handle.bytes_moved == payload and received.bytes_moved == payload
    assert (sent_stats.bytes_sent, sent_stats.transfers_ok, sent_stats.transfers_failed) == (
        payload,
        1,
        0,
    )
    stats_after = peer.stats(slot)
    assert stats_after.bytes_received - stats_before.bytes_received == payload
    assert stats_after.transfers_ok - stats_before.transfers_ok == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_int8_transfer_is_within_tolerance(
    receiver_peer: tuple[str, Peer], dtype: torch.dtype
) -> None:
    backend, peer = receiver_peer
    slot, layout = SLOT[dtype], _layout(dtype)
    sender, pool = _sender(backend, dtype, int8=True, seed=2)
    src, dst = [1, 2, 9, 25], [30, 4, 5, 11]
    tid = _tid()
    try:
        peer.expect(slot, tid, dst)
        handle = sender.send(tid, src, peer.metadata[slot], dst)
        assert handle.wait(TIMEOUT_S) is TransferState.DONE, handle.error
        received = peer.wait(tid, TIMEOUT_S)
        saved = sender.stats().bytes_saved_int8
    finally:
        sender.close()
    assert received.state is TransferState.DONE, received.error
    got, want = peer.blocks(slot, dst).float(), pool[src].float()  # [n, L, 2, bs, H, D]
    bound = _int8_steps(want) * (1 + 2**-7) / 2 + want.abs() * 2**-8 + 1e-6
    assert bool(((got - want).abs() <= bound).all())  # half a bf16 step + bf16 rounding
    assert not torch.equal(got, want)  # it really went through int8
    # quant.py's record: bf16 scales per K (layer, head, channel) and per V (layer, token,
    # head), then one int8 per element.
    scales = 2 * layout.num_layers * layout.num_kv_heads * (layout.head_dim + layout.block_size)
    record_bytes = scales + layout.elems_per_block
    assert received.bytes_moved == len(src) * record_bytes
    assert saved == len(src) * layout.block_bytes - received.bytes_moved


def _send(
    peer: Peer, sender: KVSender, slot: int, src: list[int], dst: list[int]
) -> TransferOutcome:
    """Move ``src`` to ``dst`` of the peer's endpoint ``slot``; the receiver's outcome."""
    tid = _tid()
    peer.expect(slot, tid, dst)
    handle = sender.send(tid, src, peer.metadata[slot], dst)
    assert handle.wait(TIMEOUT_S) is TransferState.DONE, handle.error
    received = peer.wait(tid, TIMEOUT_S)
    assert received.state is TransferState.DONE, received.error
    return received


@pytest.mark.parametrize("int8", [False, True], ids=["plain", "int8-config"])
def test_int8_pool_blocks_move_as_they_are(receiver_peer: tuple[str, Peer], int8: bool) -> None:
    """Between int8 pools the blocks move as stored, values and scales, whatever the
    sender's int8 setting (its int8 records are for float pools)."""
    backend, peer = receiver_peer
    sender, pool = _sender(backend, torch.int8, int8=int8, seed=4)
    src, dst = [6, 0, 31], [1, 29, 3]
    try:
        received = _send(peer, sender, SLOT[torch.int8], src, dst)
    finally:
        sender.close()
    assert torch.equal(peer.blocks(SLOT[torch.int8], dst), pool[src])
    assert received.bytes_moved == len(src) * _layout(torch.int8).block_bytes


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_float_blocks_reach_an_int8_pool_quantized(
    receiver_peer: tuple[str, Peer], dtype: torch.dtype
) -> None:
    """The sender quantizes to the receiver's int8 rows and sends those (half the bytes or
    less), bit for bit what the int8 pool itself would have stored."""
    backend, peer = receiver_peer
    sender, pool = _sender(backend, dtype, seed=5)
    src, dst = [2, 11, 8], [30, 0, 12]
    try:
        received = _send(peer, sender, SLOT[torch.int8], src, dst)
        saved = sender.stats().bytes_saved_int8
    finally:
        sender.close()
    assert torch.equal(peer.blocks(SLOT[torch.int8], dst), quantize_rows(pool[src]))
    assert received.bytes_moved == len(src) * _layout(torch.int8).block_bytes
    assert saved == len(src) * _layout(dtype).block_bytes - received.bytes_moved > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_int8_pool_blocks_reach_a_float_pool_dequantized(
    receiver_peer: tuple[str, Peer], dtype: torch.dtype
) -> None:
    backend, peer = receiver_peer
    sender, pool = _sender(backend, torch.int8, seed=6)
    src, dst = [4, 5], [9, 27]
    try:
        _send(peer, sender, SLOT[dtype], src, dst)
    finally:
        sender.close()
    assert torch.equal(peer.blocks(SLOT[dtype], dst), dequantize_rows(pool[src], dtype))


def _int8_steps(blocks: torch.Tensor) -> torch.Tensor:
    """absmax / 127 of each element's group (quant.py): K over the block's tokens, V over
    the head's channels. blocks: [n, L, 2, bs, H, D] -> the same shape."""
    magnitude = blocks.abs()
    k_steps = magnitude[:, :, 0].amax(dim=2, keepdim=True).expand_as(magnitude[:, :, 0])
    v_steps = magnitude[:, :, 1].amax(dim=4, keepdim=True).expand_as(magnitude[:, :, 1])
    return torch.stack([k_steps, v_steps], dim=2) / 127


def test_concurrent_transfers_both_complete(receiver_peer: tuple[str, Peer]) -> None:
    backend, peer = receiver_peer
    sender, pool = _sender(backend, torch.float32, seed=3)
    jobs = [(_tid(), [0, 1, 2], [12, 13, 14]), (_tid(), [20, 21], [15, 16])]
    try:
        for tid, _, dst in jobs:
            peer.expect(0, tid, dst)
        handles = [sender.send(tid, src, peer.metadata[0], dst) for tid, src, dst in jobs]
        assert [h.wait(TIMEOUT_S) for h in handles] == [TransferState.DONE] * 2
        assert [peer.wait(tid, TIMEOUT_S).state for tid, _, _ in jobs] == [TransferState.DONE] * 2
    finally:
        sender.close()
    for _, src, dst in jobs:
        assert torch.equal(_bytes(peer.blocks(0, dst)), _bytes(pool[src]))


def test_sender_rejects_bad_requests_before_moving_bytes(receiver_peer: tuple[str, Peer]) -> None:
    backend, peer = receiver_peer
    sender, _ = _sender(backend, torch.float32)
    wide = make_sender(backend, TransferConfig(timeout_s=TIMEOUT_S))
    wide.register_pool(make_pool(_layout(torch.float32, head_dim=16), None))
    meta = peer.metadata[0]
    try:
        with pytest.raises(ValueError, match="peer pool format differs"):
            wide.send(_tid(), [0], meta, [1])
        with pytest.raises(ValueError, match="dtype=bfloat16"):
            sender.send(_tid(), [0], peer.metadata[1], [1])
        with pytest.raises(ValueError, match=r"out of range for the peer's 32 blocks"):
            sender.send(_tid(), [0], meta, [40])
        with pytest.raises(ValueError, match="2 source blocks but 1 destination"):
            sender.send(_tid(), [0, 1], meta, [1])
        with pytest.raises(ValueError, match=r"source blocks: block ids \[99\] out of range"):
            sender.send(_tid(), [99], meta, [1])
        other, _ = _sender("tcp" if backend != "tcp" else "inproc", torch.float32)
        with pytest.raises(ValueError, match=f"is for the '{backend}' backend"):
            other.send(_tid(), [0], meta, [1])
        other.close()
    finally:
        sender.close()
        wide.close()
    assert sender.stats().transfers_ok == 0 and sender.stats().transfers_failed == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_expectation_without_sender_fails_then_is_forgotten(backend: str) -> None:
    receiver = make_receiver(backend, TransferConfig(timeout_s=0.5))
    sender = make_sender(backend)
    assert isinstance(receiver, KVReceiver) and isinstance(sender, KVSender)
    sender.close()
    receiver.register_pool(make_pool(_layout(torch.float32), None))
    try:
        handle = receiver.expect(_tid(), [1, 2])
        assert handle.state is TransferState.PENDING
        assert handle.wait(TIMEOUT_S) is TransferState.FAILED
        assert "timed out after 0.5s in state PENDING" in (handle.error or "")
        assert handle.outcome().history == (TransferState.PENDING, TransferState.FAILED)
        assert receiver.expect(_tid(), [1, 2]).state is TransferState.PENDING  # blocks freed
        with pytest.raises(ValueError, match="out of range"):
            receiver.expect(_tid(), [NUM_BLOCKS])
        assert receiver.stats().transfers_failed == 1
    finally:
        receiver.close()


def test_importing_kv_transfer_stays_light() -> None:
    code = (
        "import sys, pdserve.kv_transfer; "
        "heavy = ('nixl', 'pdserve.engine', 'grpc', 'ray', 'redis'); "
        "bad = [m for m in heavy if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
