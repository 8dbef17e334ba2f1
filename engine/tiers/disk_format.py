"""One file per block on the disk tier: a small header, then the block's record (``codec.py``).

    offset  size  field
    0       4     magic b"PDKT"
    4       2     version (1)
    6       2     model id length m
    8       8     block hash (u64)
    16      4     num_layers     \\
    20      4     block_size      |  the block shape the payload has
    24      4     num_kv_heads    |
    28      4     head_dim       /   (an int8 pool's: its rows' bytes, values and scale)
    32      8     payload length
    40      4     crc32 of the payload
    44      m     model id (utf-8)
    44 + m  ...   payload: the record; from a float pool k_scales (bf16), v_scales (bf16),
                  values (int8) as in kv_codec, from an int8 pool the block as it was stored

All integers little-endian. A file whose length is not ``header + payload length`` is
truncated; a payload whose crc32 differs is corrupt.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

from pdserve.engine.kv_cache.hashing import BlockHash
from pdserve.kv_codec import SCALE_DTYPE

MAGIC = b"PDKT"
VERSION = 1
_FIXED = struct.Struct("<4sHHQIIIIQI")


class TierFileError(ValueError):
    """A tier file that cannot be trusted (bad header, truncated, checksum mismatch)."""


@dataclass(slots=True, frozen=True)
class BlockShape:
    """One block's shape: ``[num_layers, 2, block_size, num_kv_heads, head_dim]``."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of_pool(cls, pool: torch.Tensor) -> BlockShape:
        """The pool tensor's block shape: an int8 pool's row (values and scale) as head_dim,
        so its files and a float pool's never pass for each other."""
        _num_blocks, layers, _two, block_size, heads, head_dim = pool.shape
        return cls(layers, block_size, heads, head_dim)

    def payload_bytes(self) -> int:
        """Bytes of a float pool block's quantized record."""
        scales = self.num_layers * self.num_kv_heads * (self.head_dim + self.block_size)
        values = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return scales * SCALE_DTYPE.itemsize + values


@dataclass(slots=True, frozen=True)
class TierFileHeader:
    block_hash: BlockHash
    model_id: str
    shape: BlockShape
    payload_bytes: int
    crc32: int

    @property
    def header_bytes(self) -> int:
        return _FIXED.size + len(self.model_id.encode())


def encode_file(block_hash: BlockHash, model_id: str, shape: BlockShape, payload: bytes) -> bytes:
    model = model_id.encode()
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
    )
    return fixed + model + payload


def decode_header(head: bytes) -> TierFileHeader:
    """The header at the start of ``head`` (which may hold more bytes than the header)."""
    if len(head) < _FIXED.size:
        raise TierFileError(f"{len(head)} bytes, shorter than the {_FIXED.size}-byte header")
    magic, version, model_len, block_hash, *dims, payload_len, crc = _FIXED.unpack_from(head)
    if magic != MAGIC or version != VERSION:
        raise TierFileError(f"magic {magic!r} version {version}, want {MAGIC!r} {VERSION}")
    model = head[_FIXED.size : _FIXED.size + model_len]
    if len(model) != model_len:
        raise TierFileError(f"model id cut short: {len(model)} of {model_len} bytes")
    return TierFileHeader(block_hash, model.decode(), BlockShape(*dims), payload_len, crc)


def decode_file(data: bytes) -> tuple[TierFileHeader, bytes]:
    """Header and verified payload of a whole file; :class:`TierFileError` if untrusted."""
    header = decode_header(data)
    payload = data[header.header_bytes :]
    if len(payload) != header.payload_bytes:
        raise TierFileError(f"payload of {len(payload)} bytes, header says {header.payload_bytes}")
    if zlib.crc32(payload) != header.crc32:
        raise TierFileError(f"payload crc32 {zlib.crc32(payload):#x} != {header.crc32:#x}")
    return header, payload


HEADER_PROBE_BYTES = _FIXED.size + 1024  # enough for any model id read at indexing
