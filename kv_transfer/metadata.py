"""Connection metadata: the opaque bytes a receiver hands to its senders.

``b"PDKM" | u32 json_len | json | blob``: the json names the backend, the receiver's pool
layout, backend fields (TCP address, NIXL buffer addresses) and, when the receiver requires
it, the connection handshake (``"auth"``, see handshake.py); the blob is backend data (the
NIXL agent metadata).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from pdserve.kv_transfer.handshake import AUTH_SCHEME
from pdserve.kv_transfer.layout import KVPoolLayout
from pdserve.kv_transfer.wire import VERSION as WIRE_VERSION

_MAGIC = b"PDKM"
_PREFIX = struct.Struct("<4sI")


@dataclass(slots=True, frozen=True)
class PeerInfo:
    backend: str
    layout: KVPoolLayout
    int8: bool  # whether the receiver accepts int8 records
    fields: dict[str, Any]
    blob: bytes = b""
    auth: bool = False  # the receiver accepts only connections that pass handshake.py


def encode_peer(info: PeerInfo) -> bytes:
    doc = {
        "backend": info.backend,
        "layout": info.layout.to_json(),
        "int8": info.int8,
        "fields": info.fields,
        # Checked before any byte moves: an int8 record's size depends on the wire version,
        # and a NIXL sender sizes the receiver's staging slots by its own.
        "wire_version": WIRE_VERSION,
    }
    if info.auth:
        doc["auth"] = AUTH_SCHEME
    text = json.dumps(doc, sort_keys=True).encode()
    return _PREFIX.pack(_MAGIC, len(text)) + text + info.blob


def decode_peer(data: bytes, backend: str) -> PeerInfo:
    """Parse metadata; ValueError if it is not ours or belongs to another backend."""
    if len(data) < _PREFIX.size or data[:4] != _MAGIC:
        raise ValueError(
            f"peer metadata is not pdserve KV connection metadata (starts {data[:8]!r})"
        )
    _, json_len = _PREFIX.unpack_from(data)
    end = _PREFIX.size + json_len
    doc = json.loads(data[_PREFIX.size : end])
    if doc["backend"] != backend:
        raise ValueError(
            f"peer metadata is for the {doc['backend']!r} backend, this sender is {backend!r}"
        )
    peer_version = doc.get("wire_version", 1)  # builds before version 2 did not say
    if peer_version != WIRE_VERSION:
        raise ValueError(
            f"peer receiver speaks KV wire version {peer_version}, this sender speaks "
            f"{WIRE_VERSION}; run the same pdserve build on prefill and decode workers"
        )
    auth = doc.get("auth")
    if auth not in (None, AUTH_SCHEME):
        raise ValueError(
            f"peer receiver requires KV handshake {auth!r}, this sender speaks {AUTH_SCHEME!r}; "
            "run the same pdserve build on both workers"
        )
    layout = KVPoolLayout.from_json(doc["layout"])
    int8 = bool(doc["int8"])
    return PeerInfo(doc["backend"], layout, int8, doc["fields"], data[end:], auth is not None)


def check_peer(
    ours: KVPoolLayout, peer: PeerInfo, dst_block_ids: tuple[int, ...], int8: bool
) -> None:
    """Sender-side check, before any byte moves: same block format, ids fit, int8 accepted."""
    if not ours.same_block_format(peer.layout):
        raise ValueError(
            f"peer pool format differs: ours {ours.describe()}, peer {peer.layout.describe()}"
        )
    bad = [b for b in dst_block_ids if b >= peer.layout.num_blocks]
    if bad:
        raise ValueError(
            f"destination block ids {bad[:8]} out of range for the peer's "
            f"{peer.layout.num_blocks} blocks"
        )
    if int8 and not peer.int8:
        raise ValueError("sender quantizes to int8 but the peer receiver was not built with int8")
