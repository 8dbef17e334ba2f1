"""NIXL notices bound to the cluster's KV key: a sender's notice carries a MAC.

A NIXL sender tells the receiver that a transfer begins, has landed or was given up with a
notice ``kind | header`` (nixl_backend.py). With a key (``TransferConfig.auth_key``, the
key of the TCP handshake, derived from the cluster secret) the sender appends::

    HMAC-SHA256(key, "pdserve-kv-nixl-notice/" | u16 len | receiver agent name | kind | header)

and the receiver checks it before it reads the header: a notice whose MAC is missing or
wrong is refused, so whoever reaches the receiver's UCX endpoint without the secret can
neither complete, fail nor start a transfer. The header holds the transfer id and the
destination blocks; the receiver's agent name (unique per process) keeps a notice meant for
one receiver from counting at another. Without a key notices go as they are (a single host
without a secret, or tests). This authenticates the notices, not the block bytes: UCX
writes them into the registered pool unencrypted and without a MAC.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

NOTICE_MAC_BYTES = 32
_DOMAIN = b"pdserve-kv-nixl-notice/"
_NAME_LEN = struct.Struct("<H")


class NoticeRefused(ValueError):
    """A notice without a valid MAC under the receiver's key."""


def seal_notice(key: bytes | None, receiver_agent: str, notice: bytes) -> bytes:
    """``notice`` with its MAC appended (as it is without a key)."""
    if key is None:
        return notice
    return notice + notice_mac(key, receiver_agent, notice)


def open_notice(key: bytes | None, receiver_agent: str, message: bytes) -> bytes:
    """The notice inside ``message`` once its MAC checks (the message itself without a
    key); NoticeRefused when the MAC is missing or wrong."""
    if key is None:
        return message
    if len(message) <= NOTICE_MAC_BYTES:
        raise NoticeRefused(
            f"a {len(message)}-byte NIXL notice is too short to carry a notice and its "
            f"{NOTICE_MAC_BYTES}-byte MAC: the sender holds no cluster KV key"
        )
    notice, mac = message[:-NOTICE_MAC_BYTES], message[-NOTICE_MAC_BYTES:]
    if not hmac.compare_digest(mac, notice_mac(key, receiver_agent, notice)):
        raise NoticeRefused(
            f"NIXL notice {notice[:1]!r} carries no valid MAC: its sender does not hold the "
            "cluster's KV key, or it was meant for another receiver"
        )
    return notice


def notice_mac(key: bytes, receiver_agent: str, notice: bytes) -> bytes:
    name = receiver_agent.encode()
    message = _DOMAIN + _NAME_LEN.pack(len(name)) + name + notice
    return hmac.new(key, message, hashlib.sha256).digest()
