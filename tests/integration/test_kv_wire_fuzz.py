"""Hostile input on the KV transfer wire, both backends: malformed, truncated, oversized,
replayed and out-of-order frames (TCP) and notifications (NIXL), and hostile connection
metadata given to a sender.

One receiver per backend over a small pool, with a real sender beside it, in this process.
Each case expects a transfer into the TARGET blocks, delivers one hostile input (TCP: bytes
on a connection of its own; NIXL: a notification from a foreign agent) and checks that

- an input naming the expected transfer with a bad header fails that transfer, with a
  reason naming it; an unreadable one names no transfer and leaves it pending (TCP: the
  connection gets an error ack saying why);
- no block outside TARGET changes (crc32 of every block, before and after);
- the receiver serves on: a transfer left pending then completes from the real sender with
  the right values, and none stays in flight (its blocks are free to expect again).

What a NIXL receiver cannot refuse is not sent: the sender WRITEs into the receiver's
registered memory itself and its completion notice is believed (NIXL peers are trusted with
the pool; NIXL itself refuses writes outside registered memory, see the metadata cases).
These receivers have no cluster key; with one, a notice must also carry a MAC
(test_kv_transfer_nixl_auth.py).

Hypothesis runs derandomized, so CI sends the same cases every run. The last test checks
the totals, so run the whole file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import struct
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdserve.kv_transfer import (
    KVPoolLayout,
    KVSender,
    TransferConfig,
    TransferHandle,
    TransferHeader,
    TransferState,
    make_receiver,
    make_sender,
)
from pdserve.kv_transfer.layout import pool_bytes
from pdserve.kv_transfer.metadata import decode_peer
from pdserve.kv_transfer.nixl_agent import NOTIFY_BEGIN, NOTIFY_DONE, NOTIFY_FAILED, Agent
from pdserve.kv_transfer.peer_process import make_pool
from pdserve.kv_transfer.sockets import ACK_ERROR, read_ack
from pdserve.kv_transfer.tcp_backend import TcpReceiver
from pdserve.kv_transfer.wire import HEADER_PREFIX_BYTES
from tests.integration.fuzzing import Tally, block_checksums, fuzz

LAYOUT = KVPoolLayout(12, 2, 4, 2, 8, torch.float32)  # 1 KiB blocks
SRC = (0, 1, 2, 3)  # in the sender's pool
TARGET = (2, 5, 6, 9)  # the expected transfer's blocks; no other block may change
PROBE_BLOCK = 11  # a NIXL barrier's expected (never written) block
OUTSIDE = [b for b in range(LAYOUT.num_blocks) if b not in TARGET]
RECEIVER_TIMEOUT_S = 3.0
IO_TIMEOUT_S = 0.5
MIN_CASES = 900
BACKENDS = ("tcp", "nixl")
_FIXED = struct.Struct("<4sHHBBHIIIII")  # the header's fixed part (kv_transfer/wire.py)


@dataclass
class Wire:
    """One backend's receiver, its pool, and a real sender to it."""

    backend: str
    receiver: Any
    pool: torch.Tensor = dataclasses.field(repr=False)
    sender: KVSender
    src_pool: torch.Tensor = dataclasses.field(repr=False)
    injector: Agent | None = None  # NIXL: a foreign agent that sends notifications
    remote: str = ""

    @property
    def metadata(self) -> bytes:
        meta: bytes = self.receiver.connection_metadata()
        return meta

    def outside(self) -> list[int]:
        sums = block_checksums(self.pool)
        return [sums[b] for b in OUTSIDE]


@pytest.fixture(scope="module")
def tally() -> Tally:
    return Tally()


@contextlib.contextmanager
def _wire(backend: str) -> Iterator[Wire]:
    config = TransferConfig(timeout_s=RECEIVER_TIMEOUT_S, io_timeout_s=IO_TIMEOUT_S)
    receiver = make_receiver(backend, config)
    pool = make_pool(LAYOUT, seed=3)  # distinct values everywhere, so any write shows
    receiver.register_pool(pool)
    sender = make_sender(backend, TransferConfig(timeout_s=RECEIVER_TIMEOUT_S))
    src_pool = make_pool(LAYOUT, seed=7)
    sender.register_pool(src_pool)
    wire = Wire(backend, receiver, pool, sender, src_pool)
    try:
        if backend == "nixl":
            wire.injector = Agent("fuzz", config.ucx_tls)
            wire.remote = wire.injector.add_remote(decode_peer(wire.metadata, "nixl").blob)
        yield wire
    finally:
        sender.close()
        receiver.close()
        if wire.injector is not None:
            wire.injector.close()


@pytest.fixture(scope="module")
def tcp_wire() -> Iterator[Wire]:
    with _wire("tcp") as wire:
        yield wire


@pytest.fixture(scope="module")
def nixl_wire() -> Iterator[Wire]:
    with _wire("nixl") as wire:
        yield wire


@pytest.fixture(scope="module", params=BACKENDS)
def wire(request: pytest.FixtureRequest) -> Wire:
    found: Wire = request.getfixturevalue(f"{request.param}_wire")
    return found


def _tid() -> str:
    return f"fuzz-{uuid.uuid4().hex[:12]}"


def _header(tid: str, **change: Any) -> TransferHeader:
    base = TransferHeader.for_layout(LAYOUT, tid, TARGET, int8=False)
    return dataclasses.replace(base, **change)


def _records(pool: torch.Tensor, blocks: tuple[int, ...]) -> bytes:
    view = pool_bytes(pool)
    return b"".join(view[b].tobytes() for b in blocks)


def _with_crc(body: bytes) -> bytes:
    return body + zlib.crc32(body).to_bytes(4, "little")


# --- delivering an input, and what must hold after it --------------------------------------


def _tcp(wire: Wire, data: bytes) -> str:
    """``data`` on a connection of its own; the receiver's verdict ("" = accepted)."""
    receiver: TcpReceiver = wire.receiver
    with socket.create_connection(receiver.address, timeout=10) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)  # a rejected frame is drained, so no RST here
            status, text = read_ack(sock, time.monotonic() + 15, 15)
        except OSError as exc:  # closed with our bytes unread: its reset can beat the ack
            return f"closed without an ack ({exc})"
    return text if status == ACK_ERROR else ""


def _nixl(wire: Wire, message: bytes) -> None:
    """Send ``message`` as a notification, then wait until the receiver has handled it."""
    assert wire.injector is not None
    wire.injector.notify(wire.remote, message)
    _nixl_barrier(wire.receiver, wire.injector, wire.remote)


def _nixl_barrier(receiver: Any, injector: Agent, remote: str) -> None:
    """Notices from one agent arrive in order: once a "sender gave up" notice sent now has
    failed a probe transfer, every notice sent before it has been handled."""
    probe = _tid()
    handle: TransferHandle = receiver.expect(probe, (PROBE_BLOCK,))
    injector.notify(remote, NOTIFY_FAILED + _probe_header(probe).encode())
    deadline_s = time.monotonic() + 10
    while not handle.finished and time.monotonic() < deadline_s:
        injector.flush(0.002)
    assert handle.state is TransferState.FAILED, "the barrier notice was never handled"


def _probe_header(tid: str) -> TransferHeader:
    return TransferHeader.for_layout(LAYOUT, tid, (PROBE_BLOCK,), int8=False)


def _deliver(wire: Wire, frame: bytes, nixl_kind: bytes = NOTIFY_DONE) -> str:
    """A header (TCP: the whole frame) through the backend's door; the TCP verdict."""
    if wire.backend == "tcp":
        return _tcp(wire, frame)
    _nixl(wire, nixl_kind + frame)
    return ""


def _serve_on(wire: Wire, tid: str, handle: TransferHandle) -> str:
    """Finish the case: a pending transfer must now complete from the real sender."""
    if handle.state is TransferState.PENDING or (
        wire.backend == "nixl" and handle.state is TransferState.TRANSFERRING
    ):
        sent = wire.sender.send(tid, SRC, wire.metadata, TARGET)
        assert sent.wait(10) is TransferState.DONE, sent.error
        assert handle.wait(10) is TransferState.DONE, handle.error
        assert torch.equal(wire.pool[list(TARGET)], wire.src_pool[list(SRC)])
        return "refused, then served"
    assert handle.wait(10) is TransferState.FAILED, handle.state
    assert handle.error and tid in handle.error, handle.error
    return "failed the transfer"


def _case(wire: Wire, tally: Tally, family: str, frame_for: Any, **kw: Any) -> str:
    """One hostile header through the backend's door, with every check; its outcome."""
    tid = _tid()
    frame = frame_for(tid)
    handle = wire.receiver.expect(tid, TARGET)
    before = wire.outside()
    verdict = _deliver(wire, frame, **kw)
    if wire.backend == "tcp":
        assert verdict, f"{family}: TCP receiver accepted a bad frame"
        assert not verdict.startswith("closed without"), f"{family}: no reason given: {verdict}"
    outcome = _serve_on(wire, tid, handle)
    assert wire.outside() == before, f"{family}: a block outside the target changed"
    assert wire.receiver.stats().transfers_in_flight == 0
    tally.add(f"{wire.backend} {family}", outcome)
    return outcome


# --- headers that cannot be read: refused, the transfer untouched ---------------------------


@fuzz(60)
@given(data=st.data())
def test_truncated_headers_are_refused(wire: Wire, tally: Tally, data: st.DataObject) -> None:
    def frame(tid: str) -> bytes:
        whole = _header(tid).encode()
        return whole[: data.draw(st.integers(0, len(whole) - 1))]

    assert _case(wire, tally, "truncated header", frame) == "refused, then served"


@fuzz(80)
@given(data=st.data())
def test_corrupt_headers_are_refused(wire: Wire, tally: Tally, data: st.DataObject) -> None:
    """One byte changed anywhere: crc32 catches every single-byte error, and a changed magic,
    version or length is refused before the crc is read."""

    def frame(tid: str) -> bytes:
        whole = bytearray(_header(tid).encode())
        at = data.draw(st.integers(0, len(whole) - 1))
        whole[at] ^= data.draw(st.integers(1, 255))
        return bytes(whole)

    assert _case(wire, tally, "corrupt header", frame) == "refused, then served"


@fuzz(60)
@given(
    change=st.one_of(
        st.integers(0, 2**16 - 1).map(lambda v: ("id_len", v)),
        (st.integers(0, 2**16) | st.integers(2**20, 2**32 - 1)).map(lambda v: ("num_blocks", v)),
    )
)
def test_lengths_out_of_bounds_or_lying_are_refused(
    wire: Wire, tally: Tally, change: tuple[str, int]
) -> None:
    """The id length or block count replaced (crc recomputed): out of bounds, or a frame
    whose parts no longer add up."""
    field, value = change
    if (field, value) in (("id_len", 17), ("num_blocks", len(TARGET))):
        return  # the true values (ids here are 17 bytes)

    def frame(tid: str) -> bytes:
        whole = _header(tid).encode()
        fixed = list(_FIXED.unpack_from(whole))
        fixed[5 if field == "id_len" else 10] = value
        return _with_crc(_FIXED.pack(*fixed) + whole[HEADER_PREFIX_BYTES:-4])

    assert _case(wire, tally, f"lengths ({field})", frame) == "refused, then served"


@fuzz(60)
@given(blob=st.binary(max_size=200), magic=st.booleans())
def test_random_bytes_are_refused(wire: Wire, tally: Tally, blob: bytes, magic: bool) -> None:
    frame = (b"PDKV" if magic else b"") + blob
    assert _case(wire, tally, "random bytes", lambda _tid: frame) == "refused, then served"


# --- readable headers that do not fit: the transfer they name fails, with the reason -------

_OUT_OF_POOL = st.integers(LAYOUT.num_blocks, 2**32 - 1)
_MISMATCHES = st.one_of(
    st.sampled_from([torch.bfloat16, torch.float16]).map(lambda d: {"dtype": d}),
    st.sampled_from(["block_size", "num_layers", "num_kv_heads", "head_dim"]).flatmap(
        lambda name: (
            st.integers(1, 2**32 - 1)
            .filter(lambda v, n=name: v != getattr(LAYOUT, n))
            .map(lambda v, n=name: {n: v})
        )
    ),
    st.lists(_OUT_OF_POOL, min_size=1, max_size=len(TARGET)).map(
        lambda out: {"dst_block_ids": (*TARGET[: len(TARGET) - len(out)], *out)}
    ),
    st.permutations(TARGET)
    .filter(lambda p: tuple(p) != TARGET)
    .map(lambda p: {"dst_block_ids": tuple(p)}),
    st.lists(st.integers(0, LAYOUT.num_blocks - 1), min_size=1, max_size=8)
    .filter(lambda ids: tuple(ids) != TARGET)
    .map(lambda ids: {"dst_block_ids": tuple(ids)}),
    st.just({"int8": True}),
)


@fuzz(120)
@given(change=_MISMATCHES)
def test_headers_that_do_not_fit_fail_the_transfer_they_name(
    wire: Wire, tally: Tally, change: dict[str, Any]
) -> None:
    """Dtype, block shape, destination ids (outside the pool, reordered, others, fewer or
    more) or int8 records: a TCP int8 frame fails for want of its records."""
    outcome = _case(wire, tally, "header mismatch", lambda tid: _header(tid, **change).encode())
    assert outcome == "failed the transfer"


# --- TCP: records cut short, too many, replayed, twice at once, before expect() -----------


@fuzz(60)
@given(data=st.data())
def test_tcp_records_cut_short_fail_and_touch_only_the_target(
    tcp_wire: Wire, tally: Tally, data: st.DataObject
) -> None:
    wire = tcp_wire
    records = _records(wire.src_pool, SRC)
    cut = data.draw(st.integers(0, len(records) - 1))
    outcome = _case(wire, tally, "records cut short", lambda t: _header(t).encode() + records[:cut])
    assert outcome == "failed the transfer"


@fuzz(30)
@given(extra=st.binary(min_size=1, max_size=3000))
def test_tcp_bytes_after_the_records_are_ignored(
    tcp_wire: Wire, tally: Tally, extra: bytes
) -> None:
    """Oversized frame: the transfer is complete after its records; what follows is left
    unread (never written anywhere)."""
    wire = tcp_wire
    tid = _tid()
    handle = wire.receiver.expect(tid, TARGET)
    before = wire.outside()
    verdict = _tcp(wire, _header(tid).encode() + _records(wire.src_pool, SRC) + extra)
    assert verdict in ("",) or verdict.startswith("closed without an ack"), verdict
    assert handle.wait(10) is TransferState.DONE
    assert torch.equal(wire.pool[list(TARGET)], wire.src_pool[list(SRC)])
    assert wire.outside() == before and wire.receiver.stats().transfers_in_flight == 0
    tally.add("tcp trailing bytes", "served, trailing bytes unread")


@pytest.mark.parametrize("first_served", [True, False] * 5)
def test_tcp_replayed_and_duplicate_frames_are_refused(
    tcp_wire: Wire, tally: Tally, first_served: bool
) -> None:
    """A frame again after its transfer ended is refused at once; a second connection for a
    transfer in progress is refused without failing it (the first may still be writing)."""
    wire = tcp_wire
    tid = _tid()
    handle = wire.receiver.expect(tid, TARGET)
    frame = _header(tid).encode() + _records(wire.src_pool, SRC)
    before = wire.outside()
    if first_served:
        assert _tcp(wire, frame) == "" and handle.state is TransferState.DONE
        verdict = _tcp(wire, frame)
        assert "already ended" in verdict, verdict
        tally.add("tcp replay", "refused")
    else:
        receiver: TcpReceiver = wire.receiver
        with socket.create_connection(receiver.address, timeout=10) as first:
            first.sendall(frame[: len(frame) // 2])  # header and part of the records
            deadline_s = time.monotonic() + 10
            while handle.state is TransferState.PENDING and time.monotonic() < deadline_s:
                time.sleep(0.005)
            verdict = _tcp(wire, frame)
            assert "being received on another connection" in verdict, verdict
            first.sendall(frame[len(frame) // 2 :])
            assert read_ack(first, time.monotonic() + 10, 10)[0] != ACK_ERROR
        tally.add("tcp duplicate connection", "refused, first served")
    assert handle.wait(10) is TransferState.DONE
    assert torch.equal(wire.pool[list(TARGET)], wire.src_pool[list(SRC)])
    assert wire.outside() == before and wire.receiver.stats().transfers_in_flight == 0


def test_tcp_frame_before_its_expect_waits_for_it(tcp_wire: Wire, tally: Tally) -> None:
    """Out of order, and legitimate: a header may arrive before ``expect``; one that is
    never expected is refused after the receiver's timeout."""
    wire = tcp_wire
    receiver: TcpReceiver = wire.receiver
    tid = _tid()
    frame = _header(tid).encode() + _records(wire.src_pool, SRC)
    with socket.create_connection(receiver.address, timeout=10) as sock:
        sock.sendall(frame)
        time.sleep(0.2)
        handle = receiver.expect(tid, TARGET)
        assert read_ack(sock, time.monotonic() + 10, 10)[0] != ACK_ERROR
    assert handle.wait(10) is TransferState.DONE
    tally.add("tcp before expect()", "served")
    started_s = time.monotonic()
    assert "no expect() for transfer" in _tcp(wire, _header(_tid()).encode())
    assert time.monotonic() - started_s >= RECEIVER_TIMEOUT_S - 0.1
    tally.add("tcp never expected", "refused")


def test_tcp_stalled_and_flooding_connections_are_cut_and_capped(tally: Tally) -> None:
    """A connection that stalls mid-header is cut after the stall bound; connections past
    ``max_receive_connections`` are refused at once; the receiver then serves on."""
    config = TransferConfig(timeout_s=5.0, io_timeout_s=IO_TIMEOUT_S, max_receive_connections=4)
    receiver = TcpReceiver(config)
    pool = make_pool(LAYOUT, seed=3)
    receiver.register_pool(pool)
    sender = make_sender("tcp", TransferConfig(timeout_s=5.0))
    src_pool = make_pool(LAYOUT, seed=7)
    sender.register_pool(src_pool)
    silent = [socket.create_connection(receiver.address, timeout=10) for _ in range(4)]
    try:
        wire = Wire("tcp", receiver, pool, sender, src_pool)
        before = wire.outside()
        for _ in range(6):  # each answered at once (a peer that wrote may see a reset)
            with socket.create_connection(receiver.address, timeout=10) as extra:
                status, text = read_ack(extra, time.monotonic() + 10, 10)
            assert status == ACK_ERROR and "receiver busy: 4 connections open" in text, text
            tally.add("tcp connection flood", "refused")
        for sock in silent:  # each is cut once it has stalled IO_TIMEOUT_S
            sock.sendall(_header(_tid()).encode()[:10])
            status, text = read_ack(sock, time.monotonic() + 10, 10)
            assert status == ACK_ERROR and "timed out" in text, text
            sock.close()  # the receiver frees the slot once it reads our end
            tally.add("tcp stalled header", "refused")
        deadline_s = time.monotonic() + 20
        while True:  # serves on once a slot is free again
            tid = _tid()
            handle = receiver.expect(tid, TARGET)
            sent = sender.send(tid, SRC, receiver.connection_metadata(), TARGET)
            if sent.wait(10) is TransferState.DONE or time.monotonic() > deadline_s:
                break
            assert "receiver busy" in (sent.error or ""), sent.error
            handle.wait(10)
            time.sleep(0.05)
        assert handle.wait(10) is TransferState.DONE, sent.error
        assert torch.equal(pool[list(TARGET)], src_pool[list(SRC)])
        assert wire.outside() == before
    finally:
        for sock in silent:
            sock.close()
        sender.close()
        receiver.close()


# --- NIXL notifications -------------------------------------------------------------------


@fuzz(30)
@given(kind=st.binary(min_size=1, max_size=1).filter(lambda k: k not in b"BDF"))
def test_nixl_unknown_notice_kinds_fail_the_transfer(
    nixl_wire: Wire, tally: Tally, kind: bytes
) -> None:
    wire = nixl_wire
    outcome = _case(
        wire, tally, "unknown notice kind", lambda t: _header(t).encode(), nixl_kind=kind
    )
    assert outcome == "failed the transfer"


def test_nixl_begin_give_up_and_replayed_notices(nixl_wire: Wire, tally: Tally) -> None:
    """A lone begin notice starts nothing harmful (the real transfer completes after it);
    a give-up notice fails the transfer; notices for a transfer that ended are dropped."""
    wire = nixl_wire
    header = _header
    for _ in range(5):
        assert (
            _case(wire, tally, "begin only", lambda t: header(t).encode(), nixl_kind=NOTIFY_BEGIN)
            == "refused, then served"
        )
        assert (
            _case(
                wire, tally, "sender gave up", lambda t: header(t).encode(), nixl_kind=NOTIFY_FAILED
            )
            == "failed the transfer"
        )
    for kind in (NOTIFY_BEGIN, NOTIFY_DONE, NOTIFY_FAILED):
        tid = _tid()
        handle = wire.receiver.expect(tid, TARGET)
        assert _serve_on(wire, tid, handle) == "refused, then served"
        before = block_checksums(wire.pool)
        _nixl(wire, kind + header(tid).encode())
        assert block_checksums(wire.pool) == before and handle.state is TransferState.DONE
        tally.add("nixl replayed notice", "dropped")


def test_nixl_notices_for_unknown_transfers_are_bounded(tally: Tally) -> None:
    """Held until expected or timed out (here: not within the test), but at most 1,024
    transfers' worth: the rest are dropped and counted."""
    config = TransferConfig(timeout_s=120.0)
    receiver = make_receiver("nixl", config)
    receiver.register_pool(make_pool(LAYOUT, seed=3))
    injector = Agent("flood", config.ucx_tls)
    try:
        remote = injector.add_remote(decode_peer(receiver.connection_metadata(), "nixl").blob)
        flood = 1100
        for _ in range(flood):
            injector.notify(remote, NOTIFY_DONE + _header(_tid()).encode())
        _nixl_barrier(receiver, injector, remote)
        dropped = receiver.stats().transfers_failed - 1  # the barrier's probe failed too
        assert dropped == flood - 1024, dropped
        tally.add("nixl unknown-transfer flood", f"{flood} sent, {dropped} dropped")
    finally:
        receiver.close()
        injector.close()


# --- hostile connection metadata given to a sender ----------------------------------------


def _edit_doc(meta: bytes, edit: Any) -> bytes:
    json_len = int.from_bytes(meta[4:8], "little")
    doc = json.loads(meta[8 : 8 + json_len])
    text = json.dumps(edit(doc)).encode()
    return meta[:4] + len(text).to_bytes(4, "little") + text + meta[8 + json_len :]


def _set(path: tuple[str, ...], value: Any) -> Any:
    def edit(doc: dict[str, Any]) -> Any:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return doc

    return edit


_JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=8),
    st.lists(st.integers(), max_size=2), st.floats(allow_nan=False),
)  # fmt: skip
_PATHS = [
    ("backend",), ("wire_version",), ("int8",), ("fields",), ("layout",),
    *[("layout", k) for k in ("num_blocks", "num_layers", "block_size", "num_kv_heads",
                              "head_dim", "dtype")],
    *[("fields", k) for k in ("host", "port", "agent", "pool_addr")],
]  # fmt: skip


def _json_end(meta: bytes) -> int:
    return 8 + int.from_bytes(meta[4:8], "little")


def _stranger(meta: bytes, blob: bytes) -> bytes:
    """Metadata naming an agent the sender has not met, with ``blob`` as its NIXL metadata
    (a known agent's connection is reused without reading the blob again)."""
    renamed = _edit_doc(meta, _set(("fields", "agent"), f"stranger-{uuid.uuid4().hex[:8]}"))
    return renamed[: _json_end(renamed)] + blob


@fuzz(120)
@given(data=st.data())
def test_hostile_peer_metadata_is_a_value_error_and_the_sender_serves_on(
    wire: Wire, tally: Tally, data: st.DataObject
) -> None:
    """TCP: what ``check_destination`` says (a junk host or port that passes is a transfer
    that fails to connect, not tried here). NIXL: a real send into the expected blocks, so
    the agent metadata itself is loaded: refused, or (junk NIXL ignores) delivered."""
    meta = wire.metadata
    family, hostile = data.draw(
        st.one_of(
            st.binary(max_size=64).map(lambda b: ("random bytes", b)),
            st.integers(0, len(meta) - 1).map(lambda k: ("truncated", meta[:k])),
            st.tuples(st.sampled_from(_PATHS), _JUNK).map(
                lambda pv: ("field values", _edit_doc(meta, _set(*pv)))
            ),
            st.binary(max_size=64).map(
                lambda b: ("unknown agent, blob replaced", _stranger(meta, b))
            ),
            st.binary(min_size=1, max_size=64).map(lambda b: ("agent blob + bytes", meta + b)),
            st.just(
                ("not json", meta[:8] + b"{" * (_json_end(meta) - 8) + meta[_json_end(meta) :])
            ),
        )
    )
    tid = _tid()
    handle = wire.receiver.expect(tid, TARGET)
    before = wire.outside()
    try:
        if wire.backend == "tcp":
            wire.sender.check_destination(tid, hostile, TARGET)
        else:
            sent = wire.sender.send(tid, SRC, hostile, TARGET)
            assert sent.wait(10) is TransferState.DONE, sent.error
    except ValueError as exc:
        assert str(exc), family
        outcome = "refused"
    else:  # junk where nothing reads it, or a value equal to the real one
        outcome = "accepted (harmless)"
    if not handle.finished:
        _serve_on(wire, tid, handle)
    assert handle.wait(10) is TransferState.DONE
    assert wire.outside() == before and wire.receiver.stats().transfers_in_flight == 0
    tally.add(f"{wire.backend} peer metadata: {family}", outcome)


def test_destination_ids_outside_the_peer_pool_are_refused(wire: Wire, tally: Tally) -> None:
    """Ids past the pool the metadata states are refused before a send. Metadata that lies
    about the pool's size: NIXL refuses blocks outside the peer's registered memory, and a
    known peer's metadata must not change; a TCP receiver fails the transfer, since its
    expectation names other blocks."""
    with pytest.raises(ValueError, match="out of range for the peer's 12 blocks"):
        wire.sender.check_destination("fuzz", wire.metadata, (3, 12))
    lying = _edit_doc(wire.metadata, _set(("layout", "num_blocks"), 4096))
    for _ in range(2):  # the first may meet a new peer, the second a known one
        tid = _tid()
        handle = wire.receiver.expect(tid, TARGET)
        before = block_checksums(wire.pool)
        try:
            sent = wire.sender.send(tid, SRC, lying, (4000, 4001, 4002, 4003))
        except ValueError as exc:
            assert "refused by NIXL" in str(exc) or "differs from that agent's" in str(exc), exc
            outcome = "refused"
        else:
            assert sent.wait(10) is TransferState.FAILED and sent.error, sent.error
            outcome = "transfer failed"
        assert block_checksums(wire.pool) == before
        _serve_on(wire, tid, handle)
        tally.add(f"{wire.backend} ids outside the pool", outcome)


def test_the_wire_fuzz_counts(tally: Tally) -> None:
    print(f"\nKV wire fuzz: {tally.total()} cases\n{tally.report()}")
    assert tally.total() >= MIN_CASES, "run the whole file"
