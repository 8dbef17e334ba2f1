"""The disk tier: one checksummed file per block under a directory, bounded in bytes, LRU.

Files are written whole to a temporary name and renamed, so a crash leaves either the old
state or a complete file (plus a ``.tmp`` that the next start deletes). At start the tier
indexes the files it finds by their headers, oldest modification first; a file that fails
its header or checksum is logged and deleted. A failed write (a full disk) stops the tier
from writing, with one log line; what it holds stays readable. What it drops after start
(evicted, or failing its checks) is listed until :meth:`DiskTier.take_dropped`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from pdserve.engine.kv_cache.hashing import BlockHash
from pdserve.engine.kv_cache.tiers import LruBytes
from pdserve.engine.tiers.codec import TierCodec
from pdserve.engine.tiers.disk_format import (
    HEADER_PROBE_BYTES,
    TierFileError,
    TierFileHeader,
    decode_file,
    decode_header,
    encode_file,
)

log = logging.getLogger(__name__)

# A block's payload and the bytes read, or why its file cannot be trusted.
ReadResult = tuple[torch.Tensor, int] | OSError | TierFileError

SUFFIX = ".kvblock"


def write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file, then rename)."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class DiskTier:
    """Payloads of one model and codec (which fixes the block shape), as files under
    ``directory``."""

    def __init__(
        self, directory: str | Path, capacity_bytes: int, model_id: str, codec: TierCodec
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._model_id = model_id
        self._codec = codec
        self._lru = LruBytes(capacity_bytes)
        self.stopped = False
        self._dropped: list[BlockHash] = []
        self._index_existing()

    @property
    def used_bytes(self) -> int:
        return self._lru.used_bytes

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def __iter__(self) -> Iterator[BlockHash]:
        """Least recently used first."""
        return iter(self._lru)

    def take_dropped(self) -> list[BlockHash]:
        """Hashes dropped since the last call (evicted, or their file failed its checks)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def put(self, block_hash: BlockHash, payload: torch.Tensor) -> int:
        """Store ``payload`` as most recent; return the bytes written (0 once stopped or
        failed)."""
        if self.stopped:
            return 0
        c = self._codec
        data = encode_file(block_hash, self._model_id, c.tag, c.shape, payload.numpy().tobytes())
        try:
            write_file(self._path(block_hash), data)
        except OSError as err:
            self.stopped = True
            log.error("disk KV tier at %s stops writing: %s", self.directory, err)
            return 0
        for evicted in self._lru.add(block_hash, len(data)):
            self._delete(evicted)
            self._dropped.append(evicted)
        return len(data)

    def get(self, block_hash: BlockHash) -> tuple[torch.Tensor, int] | None:
        """The payload and the bytes read, or None (not held, or its file failed its checks:
        then the file is logged and deleted)."""
        if block_hash not in self._lru:
            return None
        return self.accept(block_hash, self.read(block_hash))

    def read(self, block_hash: BlockHash) -> ReadResult:
        """Read and check the block's file, changing nothing: safe off the engine's thread
        (a prefetch), with :meth:`accept` on it afterwards."""
        try:
            data = self._path(block_hash).read_bytes()
            header, payload = decode_file(data)
            self._check_header_is_ours(header)
            if header.block_hash != block_hash:
                raise TierFileError(f"holds block {header.block_hash:016x}")
        except (OSError, TierFileError) as err:
            return err
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8), len(data)

    def accept(self, block_hash: BlockHash, result: ReadResult) -> tuple[torch.Tensor, int] | None:
        """What :meth:`read` gave, on the engine's thread: the payload (now most recent), or
        None; a file that failed its checks is logged and deleted."""
        if block_hash not in self._lru:
            return None  # evicted since the read
        if isinstance(result, Exception):
            path = self._path(block_hash)
            log.warning("disk KV tier: dropping %s: %s", path.name, result)
            self._lru.remove(block_hash)
            self._unlink(path)
            self._dropped.append(block_hash)
            return None
        self._lru.touch(block_hash)
        return result

    # -- internals ---------------------------------------------------------------------
    def _path(self, block_hash: BlockHash) -> Path:
        return self.directory / f"{block_hash:016x}{SUFFIX}"

    def _delete(self, block_hash: BlockHash) -> None:
        self._unlink(self._path(block_hash))

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            log.warning("disk KV tier: cannot delete %s: %s", path, err)

    def _check_header_is_ours(self, header: TierFileHeader) -> None:
        c = self._codec
        theirs = (header.model_id, header.codec_tag, header.shape)
        if theirs != (self._model_id, c.tag, c.shape):
            raise TierFileError(f"holds {theirs}, not {(self._model_id, c.tag, c.shape)}")
        if header.payload_bytes != c.payload_bytes:
            raise TierFileError(
                f"payload of {header.payload_bytes} bytes, the codec needs {c.payload_bytes}"
            )

    def _index_existing(self) -> None:
        for tmp in self.directory.glob("*.tmp"):
            self._unlink(tmp)
        files = sorted(self.directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime_ns)
        for path in files:
            block_hash = self._indexable(path)
            if block_hash is None:
                self._unlink(path)
                continue
            for evicted in self._lru.add(block_hash, path.stat().st_size):
                self._delete(evicted)
        if files:
            log.info("disk KV tier at %s: %d blocks indexed", self.directory, len(self._lru))

    def _indexable(self, path: Path) -> BlockHash | None:
        """The file's block hash if its header is ours, names it and matches its size."""
        try:
            with open(path, "rb") as f:
                header = decode_header(f.read(HEADER_PROBE_BYTES))
            self._check_header_is_ours(header)
            size = path.stat().st_size
            if size != header.header_bytes + header.payload_bytes:
                raise TierFileError(
                    f"{size} bytes, header says {header.header_bytes} + {header.payload_bytes}"
                )
            if path.name != self._path(header.block_hash).name:
                raise TierFileError(f"named {path.name} but holds {header.block_hash:016x}")
        except (OSError, TierFileError) as err:
            log.warning("disk KV tier: dropping %s: %s", path.name, err)
            return None
        return header.block_hash
