"""Connection metadata: a sender refuses a receiver of another wire version before any write."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.kv_transfer.layout import KVPoolLayout
from pdserve.kv_transfer.metadata import PeerInfo, decode_peer, encode_peer
from pdserve.kv_transfer.wire import VERSION

LAYOUT = KVPoolLayout(8, 2, 16, 3, 64, torch.float32)


def _rewrite_doc(data: bytes, change: dict[str, object], drop: str | None = None) -> bytes:
    """The same metadata with its JSON document edited (length prefix kept consistent)."""
    prefix_size = 8  # magic (4) + JSON length (u32)
    json_len = int.from_bytes(data[4:8], "little")
    doc = json.loads(data[prefix_size : prefix_size + json_len])
    doc.update(change)
    if drop:
        del doc[drop]
    text = json.dumps(doc).encode()
    return data[:4] + len(text).to_bytes(4, "little") + text + data[prefix_size + json_len :]


def test_round_trip_keeps_the_peer() -> None:
    info = PeerInfo("tcp", LAYOUT, True, {"host": "127.0.0.1", "port": 1}, b"blob")
    back = decode_peer(encode_peer(info), "tcp")
    assert (back.layout, back.int8, back.fields, back.blob) == (LAYOUT, True, info.fields, b"blob")


def test_a_receiver_of_another_wire_version_is_refused() -> None:
    data = encode_peer(PeerInfo("nixl", LAYOUT, True, {}))
    with pytest.raises(ValueError, match=f"wire version {VERSION + 1}, this sender speaks"):
        decode_peer(_rewrite_doc(data, {"wire_version": VERSION + 1}), "nixl")


def test_a_receiver_from_before_versioned_metadata_counts_as_version_1() -> None:
    data = encode_peer(PeerInfo("nixl", LAYOUT, True, {}))
    with pytest.raises(ValueError, match="wire version 1, this sender speaks"):
        decode_peer(_rewrite_doc(data, {}, drop="wire_version"), "nixl")
