"""Blocking socket helpers with deadlines, and the one-message ack of the TCP backend."""

from __future__ import annotations

import logging
import socket
import struct
import time

ACK_OK = 0
ACK_ERROR = 1
_ACK = struct.Struct("<BH")
_MAX_ACK_TEXT_BYTES = 4000
_DRAIN_S = 2.0  # how long a rejected connection is read (and discarded) before closing

log = logging.getLogger(__name__)


def _arm(sock: socket.socket, deadline_s: float, io_timeout_s: float) -> None:
    """Bound the next operation by both the stall limit and the transfer deadline."""
    remaining_s = deadline_s - time.monotonic()
    if remaining_s <= 0:
        raise TimeoutError(f"transfer deadline passed {-remaining_s:.2f}s ago")
    sock.settimeout(min(io_timeout_s, remaining_s))


def send_all(
    sock: socket.socket, data: bytes | memoryview, deadline_s: float, io_timeout_s: float
) -> None:
    _arm(sock, deadline_s, io_timeout_s)
    sock.sendall(data)


def recv_into_exact(
    sock: socket.socket, view: memoryview, deadline_s: float, io_timeout_s: float
) -> None:
    """Fill ``view`` completely; ConnectionError if the peer closes first."""
    got = 0
    while got < len(view):
        _arm(sock, deadline_s, io_timeout_s)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {len(view)} bytes")
        got += n


def recv_exact(sock: socket.socket, n: int, deadline_s: float, io_timeout_s: float) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline_s, io_timeout_s)
    return bytes(buf)


def encode_ack(status: int, text: str = "") -> bytes:
    raw = text.encode()[:_MAX_ACK_TEXT_BYTES]
    return _ACK.pack(status, len(raw)) + raw


def read_ack(sock: socket.socket, deadline_s: float, io_timeout_s: float) -> tuple[int, str]:
    status, size = _ACK.unpack(recv_exact(sock, _ACK.size, deadline_s, io_timeout_s))
    text = recv_exact(sock, size, deadline_s, io_timeout_s).decode(errors="replace")
    return status, text


def rejection_if_any(sock: socket.socket) -> str:
    """The receiver's reason, when it rejected the transfer before the connection broke."""
    try:
        status, text = read_ack(sock, time.monotonic() + 0.5, 0.5)
    except OSError:
        return ""
    return f"; receiver said: {text}" if status == ACK_ERROR else ""


def reject(conn: socket.socket, reason: str) -> None:
    """Send the error ack, then keep reading (discarding) for a bounded time.

    Closing with unread input makes the kernel send RST, which can destroy the ack before
    the sender reads it; draining lets the sender finish writing and read the reason.
    """
    send_quietly(conn, encode_ack(ACK_ERROR, reason))
    try:
        conn.shutdown(socket.SHUT_WR)
        deadline_s = time.monotonic() + _DRAIN_S
        while time.monotonic() < deadline_s and conn.recv(1 << 16):
            pass
    except OSError as exc:  # peer gone or silent: nothing more to do for it
        log.info("KV TCP drain after rejection ended: %s", exc)


def send_quietly(conn: socket.socket, data: bytes) -> None:
    """Best-effort ack: the peer may already be gone, which its own side reports."""
    try:
        conn.settimeout(1.0)
        conn.sendall(data)
    except OSError as exc:
        log.info("KV TCP ack not delivered: %s", exc)
