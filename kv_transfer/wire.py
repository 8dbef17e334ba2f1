"""The KV wire layout: one header per transfer, then one record per block.

::

    header (little-endian)
      0  magic        4s   b"PDKV"
      4  version      u16  2 (1 is refused: see RETIRED_VERSIONS)
      6  flags        u16  bit 0: int8 records (see quant.py)
      8  dtype        u8   the receiver's pool dtype code (layout.DTYPE_CODES; 4: int8 rows)
      9  reserved     u8   0
     10  id_len       u16  bytes of the utf-8 transfer id
     12  block_size   u32
     16  num_layers   u32
     20  num_kv_heads u32
     24  head_dim     u32
     28  num_blocks   u32  n
     32  transfer id  id_len bytes
         dst blocks   u32 * n   destination block ids, in record order
         crc32        u32  over every header byte before it
    records, n of them, each one contiguous byte range
      plain: block bytes in the receiver's pool format, [num_layers, 2, block_size, heads,
             row] i.e. per layer, K then V (the pool's own block layout; an int8 pool's rows
             hold head_dim int8 values and their bf16 scale; a sender of the other pool kind
             converts: convert.py)
      int8:  (between float pools only)
             k_scales bf16 [num_layers, num_kv_heads, head_dim]   (per channel, over tokens)
             v_scales bf16 [num_layers, block_size, num_kv_heads] (per token, over channels)
             values   int8 [num_layers, 2, block_size, num_kv_heads, head_dim]
             (quant.py has the scheme and its error bound)

The TCP backend streams header + records. The NIXL backend writes the records straight into
the receiver's memory and sends the header as the completion notification. Either way the
receiver checks the header against its pool and its expectation with ``validate_header``.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.kv_transfer import quant
from pdserve.kv_transfer.layout import DTYPE_CODES, DTYPE_NAMES, DTYPES_BY_CODE, KVPoolLayout

MAGIC = b"PDKV"
VERSION = 2
# Versions this side once spoke and now refuses, with why (a sender from an older build).
RETIRED_VERSIONS: dict[int, str] = {
    1: "its int8 records carry one f32 scale per (block, layer, K/V); version 2 sends bf16 "
    "scales per K channel and per V token, so the record sizes differ",
}
FLAG_INT8 = 1
_FIXED = struct.Struct("<4sHHBBHIIIII")
_CRC = struct.Struct("<I")
HEADER_PREFIX_BYTES = _FIXED.size
MAX_TRANSFER_ID_BYTES = 256
MAX_BLOCKS_PER_TRANSFER = 1 << 20


class WireFormatError(ValueError):
    """A header or frame that does not match the wire layout or the receiver's pool."""


@dataclass(slots=True, frozen=True)
class TransferHeader:
    """What a receiver needs to check a transfer before trusting its records."""

    transfer_id: str
    dtype: torch.dtype
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dst_block_ids: tuple[int, ...]
    int8: bool = False

    @classmethod
    def for_layout(
        cls, layout: KVPoolLayout, transfer_id: str, dst_block_ids: Sequence[int], int8: bool
    ) -> TransferHeader:
        return cls(
            transfer_id,
            layout.dtype,
            layout.block_size,
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            tuple(dst_block_ids),
            int8,
        )

    @property
    def num_blocks(self) -> int:
        return len(self.dst_block_ids)

    def layout(self, num_blocks: int) -> KVPoolLayout:
        """The sender's block format, as a layout with ``num_blocks`` blocks."""
        return KVPoolLayout(
            num_blocks,
            self.num_layers,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
        )

    def record_bytes(self) -> int:
        layout = self.layout(1)
        return quant.record_bytes(layout) if self.int8 else layout.block_bytes

    def payload_bytes(self) -> int:
        return self.num_blocks * self.record_bytes()

    def encode(self) -> bytes:
        tid = self.transfer_id.encode()
        if not 0 < len(tid) <= MAX_TRANSFER_ID_BYTES:
            raise ValueError(
                f"transfer id must be 1..{MAX_TRANSFER_ID_BYTES} utf-8 bytes, got {len(tid)}"
            )
        fixed = _FIXED.pack(
            MAGIC,
            VERSION,
            FLAG_INT8 if self.int8 else 0,
            DTYPE_CODES[self.dtype],
            0,
            len(tid),
            self.block_size,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.num_blocks,
        )
        ids = struct.pack(f"<{self.num_blocks}I", *self.dst_block_ids)
        body = fixed + tid + ids
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def decode(cls, buf: bytes) -> TransferHeader:
        """Parse a complete header; WireFormatError names what is wrong."""
        total = header_length(buf[:HEADER_PREFIX_BYTES])
        if len(buf) != total:
            raise WireFormatError(f"short frame: header is {total} bytes, got {len(buf)}")
        (want_crc,) = _CRC.unpack_from(buf, total - _CRC.size)
        got_crc = zlib.crc32(buf[: total - _CRC.size])
        if want_crc != got_crc:
            raise WireFormatError(
                f"corrupt header: crc32 {got_crc:#010x} != {want_crc:#010x} sent by the sender"
            )
        _, _, flags, code, _, id_len, bs, layers, heads, dim, n = _FIXED.unpack_from(buf)
        if code not in DTYPES_BY_CODE:
            raise WireFormatError(f"corrupt header: unknown dtype code {code}")
        start = HEADER_PREFIX_BYTES
        tid = buf[start : start + id_len].decode(errors="replace")
        ids = struct.unpack_from(f"<{n}I", buf, start + id_len)
        dtype = DTYPES_BY_CODE[code]
        return cls(tid, dtype, bs, layers, heads, dim, ids, bool(flags & FLAG_INT8))


def header_length(prefix: bytes) -> int:
    """Total header bytes, from its first HEADER_PREFIX_BYTES bytes."""
    if len(prefix) < HEADER_PREFIX_BYTES:
        raise WireFormatError(
            f"short frame: need {HEADER_PREFIX_BYTES} header bytes, got {len(prefix)}"
        )
    magic, version, _, _, _, id_len, *_, n = _FIXED.unpack_from(prefix)
    if magic != MAGIC:
        raise WireFormatError(f"corrupt header: magic {magic!r}, expected {MAGIC!r}")
    if version in RETIRED_VERSIONS:
        raise WireFormatError(
            f"sender speaks retired wire version {version}, this receiver speaks {VERSION}: "
            f"{RETIRED_VERSIONS[version]}; run the same pdserve build on prefill and decode"
        )
    if version != VERSION:
        raise WireFormatError(f"unsupported wire version {version}; this side speaks {VERSION}")
    if not 0 < id_len <= MAX_TRANSFER_ID_BYTES or not 0 < n <= MAX_BLOCKS_PER_TRANSFER:
        raise WireFormatError(f"corrupt header: id_len={id_len} num_blocks={n} out of bounds")
    return HEADER_PREFIX_BYTES + id_len + 4 * n + _CRC.size


def validate_header(
    header: TransferHeader, layout: KVPoolLayout, expected_dst_ids: Sequence[int]
) -> None:
    """Check a header against the receiver's pool and expectation.

    Raises WireFormatError naming the first mismatch (dtype, block shape, block ids).
    """
    tid = header.transfer_id
    if header.dtype != layout.dtype:
        raise WireFormatError(
            f"transfer {tid!r}: dtype mismatch: sender sends {DTYPE_NAMES[header.dtype]}, "
            f"receiver pool holds {DTYPE_NAMES[layout.dtype]}"
        )
    sent = header.layout(layout.num_blocks)
    if sent.block_shape != layout.block_shape:
        raise WireFormatError(
            f"transfer {tid!r}: block shape mismatch: sender [layers, 2, block_size, kv_heads, "
            f"head_dim] = {list(sent.block_shape)}, receiver {list(layout.block_shape)}"
        )
    if tuple(header.dst_block_ids) != tuple(expected_dst_ids):
        raise WireFormatError(
            f"transfer {tid!r}: destination blocks {list(header.dst_block_ids)[:16]} differ "
            f"from the {len(expected_dst_ids)} expected {list(expected_dst_ids)[:16]}"
        )
