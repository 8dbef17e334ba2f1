"""Prefix-cache block hashes: the one function router, workers and the Redis index share.

Contract (design.md, "Block hash")::

    h(0) = H(None,   tokens[0:B],   extra_keys)
    h(i) = H(h(i-1), tokens[iB:(i+1)B], extra_keys)      full blocks only (B = block size)

``H`` is SHA-256 over a canonical little-endian byte encoding, truncated to its first 8 bytes
read as an unsigned little-endian integer: a ``BlockHash`` is a Python ``int`` in
``[0, 2**64)``. It never depends on Python's ``hash()`` or a process seed, so any process
computing it from the same token ids and extra keys gets the same value.

Byte encoding of one block (all integers little-endian)::

    b"pdserve.block.v1"                       domain tag (16 bytes)
    0x00 | 0x01 + u64 parent                  no parent (first block) | parent hash
    u32 number of tokens, then u32 per token  token ids must be in [0, 2**32)
    u32 number of extra keys, then per key: u32 byte length + UTF-8 bytes

``extra_keys`` is a tuple of strings; build it with :func:`make_extra_keys` so that the model
id, LoRA name and cache salt are tagged and cannot be confused with one another.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = int

_DOMAIN = b"pdserve.block.v1"
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def make_extra_keys(
    model_id: str, lora_name: str | None = None, cache_salt: str | None = None
) -> tuple[str, ...]:
    """The extra keys of the block-hash contract: model id, then LoRA name and salt if given."""
    if not model_id:
        raise ValueError("model_id must be a non-empty string (it keys the prefix cache)")
    keys = [f"model:{model_id}"]
    if lora_name is not None:
        keys.append(f"lora:{lora_name}")
    if cache_salt is not None:
        keys.append(f"salt:{cache_salt}")
    return tuple(keys)


def encode_extra_keys(extra_keys: Sequence[str]) -> bytes:
    """Canonical bytes of ``extra_keys`` (count, then length-prefixed UTF-8 strings)."""
    parts = [_U32.pack(len(extra_keys))]
    for key in extra_keys:
        if not isinstance(key, str):
            raise ValueError(f"extra keys must be strings, got {key!r} ({type(key).__name__})")
        data = key.encode("utf-8")
        parts.append(_U32.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def hash_block(
    parent: BlockHash | None, block_token_ids: Sequence[int], encoded_extra_keys: bytes
) -> BlockHash:
    """``H(parent, tokens, extra)`` for one block; ``encoded_extra_keys`` from
    :func:`encode_extra_keys` (encoded once per sequence, not per block)."""
    parent_bytes = b"\x00" if parent is None else b"\x01" + _U64.pack(parent)
    try:
        tokens = struct.pack(f"<{len(block_token_ids)}I", *block_token_ids)
    except struct.error as err:
        bad = [t for t in block_token_ids if not (isinstance(t, int) and 0 <= t < 2**32)]
        raise ValueError(f"token ids must be ints in [0, 2**32), got {bad[:5]}") from err
    digest = hashlib.sha256(
        _DOMAIN + parent_bytes + _U32.pack(len(block_token_ids)) + tokens + encoded_extra_keys
    ).digest()
    return int.from_bytes(digest[:8], "little")


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str] = (),
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block is ignored).

    ``parent`` chains onto an earlier run of blocks: the hashes of ``a + b`` (with ``len(a)``
    a multiple of ``block_size``) are ``block_hashes(a) + block_hashes(b, parent=last of a)``.
    """
    hasher = BlockHasher(block_size, extra_keys, parent=parent)
    return hasher.update(token_ids)


class BlockHasher:
    """Incremental block hashes of one growing sequence: each full block is hashed once.

    ``update(all_token_ids)`` hashes only the blocks that became full since the last call,
    so a decoding sequence costs one SHA-256 per ``block_size`` tokens, not a rehash per step.
    The caller passes the whole (growing) token list; earlier tokens must not change.
    """

    __slots__ = ("_block_size", "_extra", "_hashes", "_parent")

    def __init__(
        self,
        block_size: int,
        extra_keys: Sequence[str] = (),
        *,
        parent: BlockHash | None = None,
        encoded_extra_keys: bytes | None = None,
        known_hashes: Sequence[BlockHash] = (),
    ) -> None:
        """``known_hashes``: hashes of the sequence's first full blocks, already computed
        (e.g. by a prefix lookup over the same tokens), so they are not hashed again."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._block_size = block_size
        self._extra = (
            encoded_extra_keys if encoded_extra_keys is not None else encode_extra_keys(extra_keys)
        )
        self._parent = parent
        self._hashes: list[BlockHash] = list(known_hashes)

    @property
    def hashes(self) -> tuple[BlockHash, ...]:
        """Hashes of the full blocks seen so far, in block order."""
        return tuple(self._hashes)

    @property
    def num_hashed_blocks(self) -> int:
        return len(self._hashes)

    def hash_at(self, block_index: int) -> BlockHash:
        return self._hashes[block_index]

    def update(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Hash the blocks of ``token_ids`` that are full and not hashed yet; return them."""
        size = self._block_size
        start = len(self._hashes)
        new: list[BlockHash] = []
        for index in range(start, len(token_ids) // size):
            prev = self._hashes[-1] if self._hashes else self._parent
            block_hash = hash_block(prev, token_ids[index * size : (index + 1) * size], self._extra)
            self._hashes.append(block_hash)
            new.append(block_hash)
        return new

    def copy(self, num_blocks: int | None = None) -> BlockHasher:
        """An independent hasher knowing the first ``num_blocks`` hashes (default: all).

        A forked sequence keeps only the blocks whose tokens it shares with its parent.
        """
        known = self._hashes if num_blocks is None else self._hashes[:num_blocks]
        return BlockHasher(
            self._block_size,
            parent=self._parent,
            encoded_extra_keys=self._extra,
            known_hashes=known,
        )
