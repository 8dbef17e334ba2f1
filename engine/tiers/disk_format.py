"""One file per block on the disk tier: a small header, then the codec's payload.

    offset      size  field
    0           4     magic b"PDKT"
    4           2     version (2)
    6           2     model id length m
    8           8     block hash (u64)
    16          4     num_layers     \\
    20          4     block_size      |  the block shape the payload has
    24          4     num_kv_heads    |
    28          4     head_dim       /
    32          8     payload length
    40          4     crc32 of the payload
    44          2     codec tag length t
    46          m     model id (utf-8)
    46 + m      t     codec tag (utf-8, ``TierCodec.tag``: "exact-bfloat16", "int8", ...)
    46 + m + t  ...   payload, as ``engine/tiers/codec.py`` lays it out

All integers little-endian. A file whose length is not ``header + payload length`` is
truncated; a payload whose crc32 differs is corrupt.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from pdserve.engine.kv_cache.hashing import BlockHash
from pdserve.engine.tiers.codec import BlockShape

MAGIC = b"PDKT"
VERSION = 2
_FIXED = struct.Struct("<4sHHQIIIIQIH")


class TierFileError(ValueError):
    """A tier file that cannot be trusted (bad header, truncated, checksum mismatch)."""


@dataclass(slots=True, frozen=True)
class TierFileHeader:
    block_hash: BlockHash
    model_id: str
    codec_tag: str
    shape: BlockShape
    payload_bytes: int
    crc32: int

    @property
    def header_bytes(self) -> int:
        return _FIXED.size + len(self.model_id.encode()) + len(self.codec_tag.encode())


def encode_file(
    block_hash: BlockHash, model_id: str, codec_tag: str, shape: BlockShape, payload: bytes
) -> bytes:
    model, tag = model_id.encode(), codec_tag.encode()
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        len(model),
        block_hash,
        shape.num_layers,
        shape.block_size,
        shape.num_kv_heads,
        shape.head_dim,
        len(payload),
        zlib.crc32(payload),
        len(tag),
    )
    return fixed + model + tag + payload


def decode_header(head: bytes) -> TierFileHeader:
    """The header at the start of ``head`` (which may hold more bytes than the header)."""
    if len(head) < _FIXED.size:
        raise TierFileError(f"{len(head)} bytes, shorter than the {_FIXED.size}-byte header")
    magic, version, model_len, block_hash, *dims, payload_len, crc, tag_len = _FIXED.unpack_from(
        head
    )
    if magic != MAGIC or version != VERSION:
        raise TierFileError(f"magic {magic!r} version {version}, want {MAGIC!r} {VERSION}")
    names = head[_FIXED.size : _FIXED.size + model_len + tag_len]
    if len(names) != model_len + tag_len:
        raise TierFileError(f"model id and codec cut short: {len(names)} of {model_len + tag_len}")
    model, tag = names[:model_len].decode(), names[model_len:].decode()
    return TierFileHeader(block_hash, model, tag, BlockShape(*dims), payload_len, crc)


def decode_file(data: bytes) -> tuple[TierFileHeader, bytes]:
    """Header and verified payload of a whole file; :class:`TierFileError` if untrusted."""
    header = decode_header(data)
    payload = data[header.header_bytes :]
    if len(payload) != header.payload_bytes:
        raise TierFileError(f"payload of {len(payload)} bytes, header says {header.payload_bytes}")
    if zlib.crc32(payload) != header.crc32:
        raise TierFileError(f"payload crc32 {zlib.crc32(payload):#x} != {header.crc32:#x}")
    return header, payload


HEADER_PROBE_BYTES = _FIXED.size + 1024  # enough for any model id and codec tag
