"""Faults: a peer killed mid-transfer, and frames or headers the receiver must reject.

"Mid-transfer" is made real with the sender's injected pause: part of the blocks have
landed in the receiver's pool (asserted) when the peer is killed.
"""

from __future__ import annotations

import dataclasses
import socket
import time
import uuid
import zlib
from collections.abc import Callable, Iterator

import pytest
import torch

from pdserve.kv_transfer import (
    BACKENDS,
    FaultInjection,
    KVPoolLayout,
    TransferConfig,
    TransferHandle,
    TransferHeader,
    TransferState,
    make_receiver,
    make_sender,
)
from pdserve.kv_transfer.inproc_backend import InprocReceiver
from pdserve.kv_transfer.metadata import decode_peer
from pdserve.kv_transfer.nixl_agent import NOTIFY_DONE, Agent
from pdserve.kv_transfer.peer_process import EndpointSpec, PeerProcess, make_pool
from pdserve.kv_transfer.sockets import ACK_ERROR, read_ack
from pdserve.kv_transfer.tcp_backend import TcpReceiver

LAYOUT = KVPoolLayout(16, 4, 4, 2, 8, torch.float32)
SRC, DST = [0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]
PAUSE_AFTER_BLOCKS = 3
SEED = 11
# Bounds, not measurements: what a transfer must manage (a spawned peer's send, an injected
# header) on a machine busy with other jobs before a receiver's deadline fails it.
RECEIVER_TIMEOUT_S = 10.0
MULTI_PROCESS = ("nixl", "tcp")


def _tid() -> str:
    return f"req-{uuid.uuid4().hex[:12]}"


def _eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.mark.parametrize("backend", MULTI_PROCESS)
def test_killed_sender_fails_the_receiver_and_frees_its_blocks(backend: str) -> None:
    fault = FaultInjection(pause_after_blocks=PAUSE_AFTER_BLOCKS, pause_s=60.0)
    sender_spec = EndpointSpec(backend, "sender", LAYOUT, TransferConfig(fault=fault), SEED)
    receiver = make_receiver(backend, TransferConfig(timeout_s=RECEIVER_TIMEOUT_S))
    pool = make_pool(LAYOUT, None)
    receiver.register_pool(pool)
    sender = PeerProcess([sender_spec])
    try:
        tid = _tid()
        handle = receiver.expect(tid, DST)
        sender.send(0, tid, SRC, receiver.connection_metadata(), DST)
        src_pool = make_pool(LAYOUT, SEED)  # the same values the child generated
        head = DST[:PAUSE_AFTER_BLOCKS]
        assert _eventually(lambda: torch.equal(pool[head], src_pool[SRC[:PAUSE_AFTER_BLOCKS]]))
        assert _eventually(lambda: handle.state is TransferState.TRANSFERRING)
        assert not torch.equal(pool[DST], src_pool[SRC])  # some blocks landed, not all
        sender.kill()  # a NIXL receiver notices only at its deadline
        assert handle.wait(RECEIVER_TIMEOUT_S + 10.0) is TransferState.FAILED
        expected = "after 3 of 8 blocks" if backend == "tcp" else "in state TRANSFERRING"
        assert expected in (handle.error or ""), handle.error
        stats = receiver.stats()
        assert (stats.transfers_ok, stats.transfers_failed, stats.bytes_received) == (0, 1, 0)
        # Forgotten: the same destination blocks can be expected again at once.
        assert receiver.expect(_tid(), DST).state is TransferState.PENDING
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("backend", MULTI_PROCESS)
def test_killed_receiver_fails_the_sender(backend: str) -> None:
    receiver = PeerProcess([EndpointSpec(backend, "receiver", LAYOUT, TransferConfig())])
    # The receiver is killed during the pause; the sender finds it dead when it resumes.
    fault = FaultInjection(pause_after_blocks=PAUSE_AFTER_BLOCKS, pause_s=4.0)
    sender = make_sender(backend, TransferConfig(timeout_s=10.0, io_timeout_s=2.0, fault=fault))
    sender.register_pool(make_pool(LAYOUT, SEED))
    try:
        tid = _tid()
        receiver.expect(0, tid, DST)
        handle = sender.send(tid, SRC, receiver.metadata[0], DST)
        started = _eventually(lambda: receiver.outcome(tid).state is TransferState.TRANSFERRING)
        assert started and handle.state is TransferState.TRANSFERRING
        receiver.kill()
        assert handle.wait(20.0) is TransferState.FAILED
        assert handle.error and tid in handle.error
        assert sender.stats().transfers_failed == 1 and sender.stats().transfers_ok == 0
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("backend", MULTI_PROCESS)
def test_sender_that_gives_up_fails_the_receiver_before_its_deadline(backend: str) -> None:
    fault = FaultInjection(pause_after_blocks=PAUSE_AFTER_BLOCKS, pause_s=60.0)
    sender_spec = EndpointSpec(backend, "sender", LAYOUT, TransferConfig(fault=fault), SEED)
    receiver = make_receiver(backend, TransferConfig(timeout_s=60.0))
    receiver.register_pool(make_pool(LAYOUT, None))
    sender = PeerProcess([sender_spec])
    try:
        tid = _tid()
        handle = receiver.expect(tid, DST)
        sender.send(0, tid, SRC, receiver.connection_metadata(), DST)
        assert _eventually(lambda: handle.state is TransferState.TRANSFERRING)
        sender.close()  # closing the sender aborts its open transfer
        assert handle.wait(10.0) is TransferState.FAILED  # its own deadline is 60 s away
        expected = "short frame" if backend == "tcp" else "sender gave up"
        assert expected in (handle.error or ""), handle.error
    finally:
        sender.close()
        receiver.close()


# Receiver-side validation: the same bad headers through each backend's own door. --------


def _inject_tcp(receiver: TcpReceiver, wire: bytes, records: bytes = b"") -> str:
    """Send raw bytes to the receiver as a sender would; return its rejection text."""
    with socket.create_connection(receiver.address, timeout=5.0) as sock:
        sock.sendall(wire + records)
        sock.shutdown(socket.SHUT_WR)  # the receiver drains rejected input, so no RST here
        status, text = read_ack(sock, time.monotonic() + 10.0, 5.0)
    assert status == ACK_ERROR, "receiver accepted a bad frame"
    return text


def _inject_nixl(receiver: object, wire: bytes, handle: TransferHandle) -> str:
    """Send a completion notice as a NIXL sender would; the agent lives until it lands."""
    agent = Agent("inject", TransferConfig().ucx_tls)
    peer = decode_peer(receiver.connection_metadata(), "nixl")  # type: ignore[attr-defined]
    agent.notify(agent.add_remote(peer.blob), NOTIFY_DONE + wire)
    deadline_s = time.monotonic() + 10.0
    while not handle.finished and time.monotonic() < deadline_s:
        agent.flush(0.01)  # no progress thread: the notice leaves while we drive UCX
    agent.close()
    return ""  # a NIXL sender does not wait for the receiver's verdict


def _inject(backend: str, receiver: object, header: TransferHeader, handle: TransferHandle) -> str:
    if backend == "tcp":
        assert isinstance(receiver, TcpReceiver)
        return _inject_tcp(receiver, header.encode())
    if backend == "nixl":
        return _inject_nixl(receiver, header.encode(), handle)
    assert isinstance(receiver, InprocReceiver)
    with pytest.raises(ValueError) as info:
        blocks = make_pool(LAYOUT, SEED).index_select(0, torch.tensor(SRC[: header.num_blocks]))
        receiver.accept(header, blocks)
    return str(info.value)


@pytest.fixture(params=BACKENDS)
def local_receiver(request: pytest.FixtureRequest) -> Iterator[tuple[str, object]]:
    config = TransferConfig(timeout_s=RECEIVER_TIMEOUT_S, io_timeout_s=2.0)
    receiver = make_receiver(str(request.param), config)
    receiver.register_pool(make_pool(LAYOUT, None))
    yield str(request.param), receiver
    receiver.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": torch.bfloat16}, "sender sends bfloat16, receiver pool holds float32"),
        ({"head_dim": 16}, "block shape mismatch: sender [layers, 2, block_size, kv_heads, "
                           "head_dim] = [4, 2, 4, 2, 16], receiver [4, 2, 4, 2, 8]"),
        ({"num_layers": 5}, "= [5, 2, 4, 2, 8], receiver [4, 2, 4, 2, 8]"),
        ({"dst_block_ids": (8, 9, 10, 12)}, "destination blocks [8, 9, 10, 12] differ"),
    ],
    ids=["dtype", "head_dim", "layers", "dst_ids"],
)  # fmt: skip
def test_receiver_rejects_mismatched_headers_precisely(
    local_receiver: tuple[str, object], change: dict[str, object], message: str
) -> None:
    backend, receiver = local_receiver
    tid = _tid()
    handle: TransferHandle = receiver.expect(tid, DST[:4])  # type: ignore[attr-defined]
    rejection = _inject(backend, receiver, _header(tid, **change), handle)
    assert handle.wait(RECEIVER_TIMEOUT_S) is TransferState.FAILED
    assert message in (handle.error or ""), handle.error
    if backend != "nixl":
        assert message in rejection, rejection
    assert receiver.stats().transfers_ok == 0  # type: ignore[attr-defined]


def _header(tid: str, **change: object) -> TransferHeader:
    base = TransferHeader.for_layout(LAYOUT, tid, DST[:4], int8=False)
    return dataclasses.replace(base, **change)  # type: ignore[arg-type]


def test_tcp_receiver_rejects_corrupt_and_short_frames() -> None:
    receiver = TcpReceiver(TransferConfig(timeout_s=RECEIVER_TIMEOUT_S, io_timeout_s=2.0))
    receiver.register_pool(make_pool(LAYOUT, None))
    # A header naming no expected transfer waits the timeout for its expect(): a short one.
    impatient = TcpReceiver(TransferConfig(timeout_s=0.5, io_timeout_s=0.5))
    impatient.register_pool(make_pool(LAYOUT, None))
    try:
        tid = _tid()
        handle = receiver.expect(tid, DST[:4])
        wire = _header(tid).encode()
        corrupt = wire[:-6] + bytes([wire[-6] ^ 0xFF]) + wire[-5:]
        assert "corrupt header: crc32" in _inject_tcp(receiver, corrupt)
        assert "magic" in _inject_tcp(receiver, b"HTTP" + wire[4:])
        assert "short frame" in _inject_tcp(receiver, wire[:20])
        assert handle.state is TransferState.PENDING  # unreadable headers name no transfer
        two_blocks = make_pool(LAYOUT, SEED)[:2].numpy().tobytes()
        rejection = _inject_tcp(receiver, wire, two_blocks + b"\x01" * 100)
        assert handle.wait(5.0) is TransferState.FAILED
        assert "short frame" in (handle.error or "") and "after 2 of 4 blocks" in rejection
        unexpected = _inject_tcp(impatient, _header(_tid()).encode())
        assert "no expect() for transfer" in unexpected
        assert receiver.stats().transfers_ok == 0
    finally:
        receiver.close()
        impatient.close()


def test_tcp_receiver_refuses_a_sender_of_the_retired_int8_wire_version() -> None:
    # Wire version 1 had another int8 record size, so its records cannot be parsed at all.
    config = TransferConfig(timeout_s=RECEIVER_TIMEOUT_S, io_timeout_s=2.0, int8=True)
    receiver = TcpReceiver(config)
    receiver.register_pool(make_pool(LAYOUT, None))
    try:
        tid = _tid()
        wire = bytearray(_header(tid, int8=True).encode()[:-4])
        wire[4:6] = (1).to_bytes(2, "little")  # a version-1 sender, with a valid crc32
        v1 = bytes(wire) + zlib.crc32(wire).to_bytes(4, "little")
        rejection = _inject_tcp(receiver, v1, b"\x00" * 100)
        assert "retired wire version 1, this receiver speaks 2" in rejection, rejection
        assert "one f32 scale per (block, layer, K/V)" in rejection
        assert receiver.stats().transfers_ok == 0
    finally:
        receiver.close()


def test_nixl_sender_refuses_int8_to_a_receiver_without_staging() -> None:
    receiver = make_receiver("nixl", TransferConfig(int8=False))
    receiver.register_pool(make_pool(LAYOUT, None))
    sender = make_sender("nixl", TransferConfig(int8=True))
    sender.register_pool(make_pool(LAYOUT, SEED))
    try:
        with pytest.raises(ValueError, match="receiver was not built with int8"):
            sender.send(_tid(), [0], receiver.connection_metadata(), [1])
    finally:
        sender.close()
        receiver.close()
