"""Connection metadata: the opaque bytes a receiver hands to its senders.

``b"PDKM" | u32 json_len | json | blob``: the json names the backend, the receiver's pool
layout, backend fields (TCP address, NIXL buffer addresses), the blob's crc32 and, when the
receiver requires the cluster key, ``"auth"`` (TCP: the handshake of handshake.py; NIXL:
notices with a MAC, notice_mac.py); the blob is backend data (the NIXL agent metadata). It
reaches a sender inside a gRPC request, so ``decode_peer`` trusts none of it.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from pdserve.kv_transfer.convert import converts
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
    auth: bool = False  # the receiver requires the cluster key (handshake.py, notice_mac.py)


def encode_peer(info: PeerInfo) -> bytes:
    doc = {
        "backend": info.backend,
        "layout": info.layout.to_json(),
        "int8": info.int8,
        "fields": info.fields,
        # Checked before any byte moves: an int8 record's size depends on the wire version,
        # and a NIXL sender sizes the receiver's staging slots by its own.
        "wire_version": WIRE_VERSION,
        # A blob cut or changed on its way is refused before NIXL loads it: a blob NIXL
        # half-loads leaves that agent's connection unloadable for the sender's life.
        "blob_crc32": zlib.crc32(info.blob),
    }
    if info.auth:
        doc["auth"] = AUTH_SCHEME
    text = json.dumps(doc, sort_keys=True).encode()
    return _PREFIX.pack(_MAGIC, len(text)) + text + info.blob


def decode_peer(data: bytes, backend: str) -> PeerInfo:
    """Parse metadata; ValueError if it is not ours, is malformed, or belongs to another
    backend. It arrives from another process (in a gRPC request), so nothing in it is
    trusted: every field is type-checked here."""
    if len(data) < _PREFIX.size or data[:4] != _MAGIC:
        raise ValueError(
            f"peer metadata is not pdserve KV connection metadata (starts {data[:8]!r})"
        )
    _, json_len = _PREFIX.unpack_from(data)
    end = _PREFIX.size + json_len
    if end > len(data):
        raise ValueError(
            f"peer metadata is cut short: its JSON part is {json_len} bytes, "
            f"{len(data) - _PREFIX.size} follow"
        )
    try:
        doc = json.loads(data[_PREFIX.size : end])
    except ValueError as exc:  # also invalid UTF-8
        raise ValueError(f"peer metadata JSON is malformed: {exc}") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"peer metadata JSON must be an object, got {type(doc).__name__}")
    if doc.get("backend") != backend:
        raise ValueError(
            f"peer metadata is for the {doc.get('backend')!r} backend, this sender is {backend!r}"
        )
    peer_version = doc.get("wire_version", 1)  # builds before version 2 did not say
    if peer_version != WIRE_VERSION:
        raise ValueError(
            f"peer receiver speaks KV wire version {peer_version}, this sender speaks "
            f"{WIRE_VERSION}; run the same pdserve build on prefill and decode workers"
        )
    blob = data[end:]
    crc = doc.get("blob_crc32", zlib.crc32(blob))  # builds that did not send one: unchecked
    if crc != zlib.crc32(blob):
        raise ValueError(
            f"peer metadata is corrupt: its {len(blob)}-byte agent blob does not match the "
            "crc32 it was sent with (cut or changed on its way)"
        )
    auth = doc.get("auth")
    if auth not in (None, AUTH_SCHEME):
        raise ValueError(
            f"peer receiver requires KV handshake {auth!r:.40}, this sender speaks "
            f"{AUTH_SCHEME!r}; run the same pdserve build on both workers"
        )
    layout, int8, fields = doc.get("layout"), doc.get("int8"), doc.get("fields")
    if not isinstance(int8, bool) or not isinstance(fields, dict):
        raise ValueError(
            f"peer metadata needs int8 (a bool) and fields (an object), got {int8!r}, "
            f"{type(fields).__name__}"
        )
    return PeerInfo(backend, _layout_from_json(layout), int8, fields, blob, auth is not None)


def _layout_from_json(doc: object) -> KVPoolLayout:
    sizes = ("num_blocks", "num_layers", "block_size", "num_kv_heads", "head_dim")
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("dtype"), str)
        or not all(type(doc.get(name)) is int and 0 < doc[name] < 2**32 for name in sizes)
    ):
        raise ValueError(
            f"peer metadata layout must hold a dtype name and positive u32 {sizes}, got "
            f"{doc!r:.200}"
        )
    return KVPoolLayout.from_json(doc)


def check_peer(
    ours: KVPoolLayout, peer: PeerInfo, dst_block_ids: tuple[int, ...], int8: bool
) -> None:
    """Sender-side check, before any byte moves: the same block format (or one the sender
    converts to: ``convert.py``), ids fit, int8 accepted."""
    if not (ours.same_block_format(peer.layout) or converts(ours, peer.layout)):
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
