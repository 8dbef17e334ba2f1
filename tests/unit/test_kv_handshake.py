"""The KV connection handshake over a real socket pair: proofs, refusals, reflection."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest

from pdserve.kv_transfer.handshake import (
    HandshakeRefused,
    authenticate_receiver,
    authenticate_sender,
    check_auth_settings,
    receiver_proof,
    sender_proof,
)

KEY, OTHER_KEY = b"k" * 32, b"o" * 32


def _both_sides(
    receiver_key: bytes, sender_key: bytes
) -> tuple[BaseException | None, BaseException | None]:
    """Run both sides on a socket pair; the receiver closes its end after it, as the TCP
    receiver does with a refused connection."""
    receiver_end, sender_end = socket.socketpair()
    results: dict[str, BaseException | None] = {}

    def side(name: str, run: Callable[[], None], sock: socket.socket) -> None:
        try:
            run()
            results[name] = None
        except BaseException as err:
            results[name] = err
        finally:
            sock.close()

    deadline_s = time.monotonic() + 5
    receiver = threading.Thread(
        target=side,
        args=("r", lambda: authenticate_sender(receiver_end, receiver_key, deadline_s, 2.0),
              receiver_end),
    )  # fmt: skip
    receiver.start()
    side("s", lambda: authenticate_receiver(sender_end, sender_key, deadline_s, 2.0), sender_end)
    receiver.join(5)
    return results["r"], results["s"]


def test_same_key_passes_on_both_sides() -> None:
    assert _both_sides(KEY, KEY) == (None, None)


def test_a_sender_with_another_key_is_refused_and_learns_nothing() -> None:
    receiver_error, sender_error = _both_sides(KEY, OTHER_KEY)
    assert isinstance(receiver_error, HandshakeRefused)
    assert "did not prove" in str(receiver_error)
    assert isinstance(sender_error, HandshakeRefused)
    assert "closed the connection during the KV handshake" in str(sender_error)


def test_a_sender_without_the_handshake_is_refused_before_its_header_is_parsed() -> None:
    receiver_end, sender_end = socket.socketpair()
    with receiver_end, sender_end:
        sender_end.sendall(b"PDKV" + b"\0" * 200)  # a wire header, as a keyless sender sends
        with pytest.raises(HandshakeRefused, match="did not prove"):
            authenticate_sender(receiver_end, KEY, time.monotonic() + 5, 2.0)


def test_proofs_depend_on_role_key_and_both_nonces() -> None:
    a, b = b"a" * 32, b"b" * 32
    proof = sender_proof(KEY, a, b)
    assert proof != receiver_proof(KEY, a, b)  # a proof reflected back does not pass
    assert proof not in (sender_proof(OTHER_KEY, a, b), sender_proof(KEY, b, a))
    assert proof == sender_proof(KEY, a, b)


def test_senders_and_receivers_must_agree_before_connecting() -> None:
    check_auth_settings(True, KEY)
    check_auth_settings(False, None)
    with pytest.raises(ValueError, match="requires authenticated connections"):
        check_auth_settings(True, None)
    with pytest.raises(ValueError, match="the receiver does not"):
        check_auth_settings(False, KEY)
