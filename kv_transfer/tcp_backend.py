"""TCP fallback backend: one connection per transfer, framed by the wire header.

The sender connects, streams ``header | record * n`` (records in the receiver's pool format:
``convert.py``) and waits for a one-message ack; the receiver validates the header against
its pool and ``expect`` before it reads a record, then reads plain records straight into the
destination blocks (no staging copy) and int8 records through a small buffer. A pool on a
GPU (or any pool, with ``stage_through_host``) moves through host buffers on both sides
(``staging.py``), ``_CHUNK_BLOCKS`` blocks at a time. A closed or
silent connection fails the transfer on both sides within ``io_timeout_s`` (and always by
``timeout_s``). With an ``auth_key`` both ends first pass the handshake of handshake.py: a
connection that fails it is closed before its header is read.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pdserve.kv_transfer import quant
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.connector import TransferHandle
from pdserve.kv_transfer.convert import convert_blocks
from pdserve.kv_transfer.endpoints import ReceiverBase, SenderBase
from pdserve.kv_transfer.expectations import Expectation
from pdserve.kv_transfer.handshake import (
    authenticate_receiver,
    authenticate_sender,
    check_auth_settings,
)
from pdserve.kv_transfer.layout import KVPoolLayout, pool_bytes
from pdserve.kv_transfer.metadata import PeerInfo, encode_peer
from pdserve.kv_transfer.sockets import (
    ACK_ERROR,
    ACK_OK,
    encode_ack,
    read_ack,
    recv_exact,
    recv_into_exact,
    reject,
    rejection_if_any,
    send_all,
    send_quietly,
)
from pdserve.kv_transfer.staging import HostStaging, stages_through_host
from pdserve.kv_transfer.wire import (
    HEADER_PREFIX_BYTES,
    TransferHeader,
    WireFormatError,
    header_length,
    validate_header,
)

log = logging.getLogger(__name__)

_CHUNK_BLOCKS = 16  # stage or (de)quantize this many blocks at a time to bound memory
Address = tuple[str, int]


@dataclass(slots=True)
class _Progress:
    blocks: int = 0


class TcpSender(SenderBase):
    backend_name = "tcp"
    _staged = False

    def _on_pool_registered(self, pool: torch.Tensor, layout: KVPoolLayout) -> None:
        self._staged = stages_through_host(pool, self.config.stage_through_host)

    def _check_fields(self, peer: PeerInfo) -> None:
        host, port = peer.fields.get("host"), peer.fields.get("port")
        if not isinstance(host, str) or not host or type(port) is not int or not 0 < port < 65536:
            raise ValueError(f"peer metadata needs a TCP host and port, got {host!r}:{port!r}")

    def _connect(self, peer: PeerInfo, raw: bytes) -> Address:
        check_auth_settings(peer.auth, self.config.auth_key)
        return str(peer.fields["host"]), int(peer.fields["port"])

    def _transfer(
        self,
        handle: TransferHandle,
        target: Address,
        header: TransferHeader,
        src: tuple[int, ...],
        deadline_s: float,
    ) -> None:
        where = f"{target[0]}:{target[1]}"
        with socket.create_connection(target, timeout=self.config.io_timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            key = self.config.auth_key
            if key is not None:  # before the header: nothing moves to an unproven receiver
                authenticate_receiver(sock, key, deadline_s, self.config.io_timeout_s)
            handle.start()
            progress = _Progress()
            try:
                self._stream(sock, header, src, deadline_s, progress)
                status, text = read_ack(sock, deadline_s, self.config.io_timeout_s)
            except OSError as exc:
                reason = rejection_if_any(sock)
                raise ConnectionError(
                    f"to {where} after {progress.blocks} of {header.num_blocks} blocks: "
                    f"{type(exc).__name__}: {exc}{reason}"
                ) from exc
        if status != ACK_OK:
            raise ConnectionError(f"receiver {where} rejected it: {text}")

    def _stream(
        self,
        sock: socket.socket,
        header: TransferHeader,
        src: tuple[int, ...],
        deadline_s: float,
        progress: _Progress,
    ) -> None:
        """Write the header and the records, counting blocks sent in ``progress``."""
        io_s = self.config.io_timeout_s
        send_all(sock, header.encode(), deadline_s, io_s)
        for record in self._records(header, src):
            self._maybe_pause(progress.blocks)
            if self.closing.is_set():
                raise ConnectionAbortedError("sender closing")
            send_all(sock, record, deadline_s, io_s)
            progress.blocks += 1

    def _records(self, header: TransferHeader, src: tuple[int, ...]) -> Iterator[memoryview]:
        """Each block's wire record, in order, as a byte buffer."""
        plain = not header.int8 and header.dtype == self.pool.dtype
        if plain and not self._staged:
            view = pool_bytes(self.pool)  # [num_blocks, block_bytes]
            for block in src:
                yield memoryview(view[block])
            return
        layout = KVPoolLayout.of_pool(self.pool)
        staging = HostStaging(self.pool, _CHUNK_BLOCKS) if self._staged else None
        for start in range(0, len(src), _CHUNK_BLOCKS):
            ids = src[start : start + _CHUNK_BLOCKS]
            if staging is not None:
                blocks = staging.gather(ids)  # [n, *pool block] in host memory
            else:
                blocks = self.pool.index_select(0, torch.tensor(ids, dtype=torch.long))
            if plain:
                records = pool_bytes(blocks)
            elif header.int8:
                records = quant.encode_records(blocks, layout).numpy()
            else:  # the receiver's pool format (convert.py)
                records = pool_bytes(convert_blocks(blocks, header.layout(len(ids))))
            for row in records:
                yield memoryview(row)

    def _maybe_pause(self, sent_blocks: int) -> None:
        fault = self.config.fault
        if fault is not None and sent_blocks == fault.pause_after_blocks:
            self.closing.wait(fault.pause_s)


class TcpReceiver(ReceiverBase):
    backend_name = "tcp"

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._staged = False
        self._connection_slots = threading.BoundedSemaphore(config.max_receive_connections)

    def _on_pool_registered(self, pool: torch.Tensor, layout: KVPoolLayout) -> None:
        self._staged = stages_through_host(pool, self.config.stage_through_host)
        listener = socket.create_server((self.config.host, self.config.port), backlog=64)
        listener.settimeout(0.25)  # lets the accept loop notice close()
        self._listener = listener
        self._accept_thread = threading.Thread(
            target=self._accept_forever, name="kv-tcp-accept", daemon=True
        )
        self._accept_thread.start()

    @property
    def address(self) -> Address:
        assert self._listener is not None, "register_pool() starts the listener"
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    def connection_metadata(self) -> bytes:
        host, port = self.address
        fields = {"host": self.config.host if host in ("0.0.0.0", "::") else host, "port": port}
        auth = self.config.auth_key is not None
        return encode_peer(PeerInfo(self.backend_name, self.layout, True, fields, auth=auth))

    def _on_close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=2.0)

    def _accept_forever(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if not self._closed.is_set():
                    log.error("KV TCP listener %s failed: %s", self.address, exc)
                return
            if not self._connection_slots.acquire(blocking=False):
                self._refuse_busy(conn)
                continue
            threading.Thread(target=self._serve_in_slot, args=(conn, peer), daemon=True).start()

    def _refuse_busy(self, conn: socket.socket) -> None:
        """Answer at once from the accept thread, without draining the peer's input (that
        would block accepting): a peer that already wrote may see a reset instead."""
        limit = self.config.max_receive_connections
        with conn:
            send_quietly(conn, encode_ack(ACK_ERROR, f"receiver busy: {limit} connections open"))
        self._counters.record_failed(0.0)
        log.info("KV TCP receiver refused a connection: %d open", limit)

    def _serve_in_slot(self, conn: socket.socket, peer: Address) -> None:
        try:
            self._serve(conn, peer)
        finally:
            self._connection_slots.release()

    def _serve(self, conn: socket.socket, peer: Address) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self._authenticated(conn, peer):
                return
            exp, header = self._admit(conn)
            if exp is None or header is None:
                return
            try:
                self._receive_records(conn, header, exp)
            except OSError as exc:
                error = f"short frame: transfer {header.transfer_id!r} incomplete {exc}"
                self.table.fail(exp, error)
                reject(conn, error)
                return
            saved = quant.bytes_saved(self.layout, header.num_blocks) if header.int8 else 0
            self.table.succeed(exp, header.payload_bytes(), saved)
            send_quietly(conn, encode_ack(ACK_OK))

    def _authenticated(self, conn: socket.socket, peer: Address) -> bool:
        """Without a key, every connection; with one, only a sender that proves it. A refused
        one is closed unanswered: no header read, no expectation touched."""
        key = self.config.auth_key
        if key is None:
            return True
        deadline_s = time.monotonic() + self.config.io_timeout_s
        try:
            authenticate_sender(conn, key, deadline_s, self.config.io_timeout_s)
        except OSError as exc:
            self._counters.record_refused()
            log.warning("KV connection from %s:%d refused: %s", *peer[:2], exc)
            return False
        return True

    def _admit(self, conn: socket.socket) -> tuple[Expectation | None, TransferHeader | None]:
        """Read and check the header; on any problem reject the connection with the reason."""
        deadline_s = time.monotonic() + self.config.timeout_s
        try:
            header = self._read_header(conn, deadline_s)
        except (OSError, ValueError) as exc:
            self._counters.record_failed(0.0)
            reject(conn, f"{type(exc).__name__}: {exc}")
            return None, None
        tid = header.transfer_id
        exp = self.table.wait_for(tid, self.config.timeout_s)
        if exp is None:
            self._counters.record_failed(0.0)
            if self.table.recently_ended(tid):
                reject(conn, f"transfer {tid!r} already ended; a transfer is received once")
            else:
                reject(conn, f"no expect() for transfer {tid!r} within the timeout")
            return None, None
        # Claim before validating: a second connection for a transfer in progress is
        # refused without failing it, since the first may still be writing its blocks.
        if not self.table.start(exp, claim=True):
            if exp.handle.finished:
                reject(conn, f"transfer {tid!r} already ended: {exp.handle.error}")
            else:
                reject(conn, f"transfer {tid!r} is being received on another connection")
            return None, None
        try:
            validate_header(header, self.layout, exp.dst_block_ids)
        except ValueError as exc:
            self.table.fail(exp, str(exc))
            reject(conn, str(exc))
            return None, None
        return exp, header

    def _read_header(self, conn: socket.socket, deadline_s: float) -> TransferHeader:
        io_s = self.config.io_timeout_s
        try:
            prefix = recv_exact(conn, HEADER_PREFIX_BYTES, deadline_s, io_s)
            rest = recv_exact(conn, header_length(prefix) - len(prefix), deadline_s, io_s)
        except ConnectionError as exc:
            raise WireFormatError(f"short frame: header cut off: {exc}") from exc
        return TransferHeader.decode(prefix + rest)

    def _receive_records(
        self, conn: socket.socket, header: TransferHeader, exp: Expectation
    ) -> None:
        """Read all records into the pool; ConnectionError says how far it got."""
        done_blocks = 0
        try:
            for chunk in self._fill_chunks(conn, header, exp):
                done_blocks += chunk
        except OSError as exc:
            raise ConnectionError(
                f"after {done_blocks} of {header.num_blocks} blocks: {type(exc).__name__}: {exc}"
            ) from exc

    def _fill_chunks(
        self, conn: socket.socket, header: TransferHeader, exp: Expectation
    ) -> Iterator[int]:
        """Receive records in order, yielding how many blocks each step completed."""
        io_s, deadline_s = self.config.io_timeout_s, exp.deadline_s
        dst = exp.dst_block_ids
        if not header.int8 and not self._staged:
            view = pool_bytes(self.pool)  # [num_blocks, block_bytes]
            for block in dst:
                self._check_open()
                recv_into_exact(conn, memoryview(view[block]), deadline_s, io_s)
                yield 1
            return
        staging = HostStaging(self.pool, _CHUNK_BLOCKS) if self._staged else None
        for start in range(0, len(dst), _CHUNK_BLOCKS):
            chunk = list(dst[start : start + _CHUNK_BLOCKS])
            self._check_open()
            self._receive_chunk(conn, header, chunk, staging, deadline_s)
            yield len(chunk)

    def _receive_chunk(
        self,
        conn: socket.socket,
        header: TransferHeader,
        chunk: list[int],
        staging: HostStaging | None,
        deadline_s: float,
    ) -> None:
        """One chunk's records into ``pool[chunk]``: through the host buffers of a staged
        pool; int8 records dequantized on the host side of that copy."""
        io_s = self.config.io_timeout_s
        if not header.int8:
            assert staging is not None, "unstaged plain records go straight into the pool"
            rows = staging.buffer(len(chunk))  # [n, *pool block] in host memory
            recv_into_exact(conn, pool_bytes(rows).reshape(-1).data, deadline_s, io_s)
            staging.scatter(rows, chunk)
            return
        records = torch.empty((len(chunk), header.record_bytes()), dtype=torch.uint8)
        recv_into_exact(conn, records.numpy().reshape(-1).data, deadline_s, io_s)
        if staging is None:
            quant.decode_records_into(records, self.pool, chunk, self.layout)
            return
        rows = staging.buffer(len(chunk))
        quant.decode_records_into(records, rows, list(range(len(chunk))), self.layout)
        staging.scatter(rows, chunk)

    def _check_open(self) -> None:
        """Stop writing into the pool once close() began: the caller may free it."""
        if self._closed.is_set():
            raise ConnectionAbortedError("receiver closing")
