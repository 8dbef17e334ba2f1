"""What every backend's sender and receiver share: validation, handles, counters, shutdown.

A backend subclasses ``SenderBase`` (implementing ``_connect`` and ``_transfer``) and
``ReceiverBase`` (implementing ``connection_metadata`` and delivering into the pool).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, ClassVar

import torch

from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.connector import TransferHandle
from pdserve.kv_transfer.convert import converts
from pdserve.kv_transfer.expectations import ExpectationTable
from pdserve.kv_transfer.layout import KVPoolLayout, check_block_ids
from pdserve.kv_transfer.metadata import PeerInfo, check_peer, decode_peer
from pdserve.kv_transfer.stats import TransferCounters, TransferStats
from pdserve.kv_transfer.wire import TransferHeader

# Destination ids are range-checked against the peer's pool, which only the peer knows.
_ANY_BLOCK = 1 << 32


class SenderBase:
    """Implements ``KVSender.send`` on top of a backend's ``_connect`` and ``_transfer``."""

    backend_name: ClassVar[str] = ""

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self._counters = TransferCounters()
        self._pool: torch.Tensor | None = None
        self._layout: KVPoolLayout | None = None
        self._lock = threading.Lock()
        self._live: set[TransferHandle] = set()
        # Set by close(); transfer loops check it so close() returns promptly.
        self.closing = threading.Event()
        self._executor = ThreadPoolExecutor(
            config.max_concurrent_sends, thread_name_prefix=f"kv-{self.backend_name}-send"
        )

    def register_pool(self, pool: torch.Tensor) -> None:
        if self._pool is not None:
            raise ValueError("a KV pool is already registered with this sender")
        self._layout = KVPoolLayout.of_pool(pool)
        self._pool = pool
        self._on_pool_registered(pool, self._layout)

    def send(
        self,
        transfer_id: str,
        src_block_ids: Sequence[int],
        peer: bytes,
        dst_block_ids: Sequence[int],
    ) -> TransferHandle:
        layout = self._require_layout()
        src = check_block_ids(src_block_ids, layout.num_blocks, "source blocks")
        info, header = self._plan(transfer_id, peer, dst_block_ids)
        if len(src) != header.num_blocks:
            raise ValueError(f"{len(src)} source blocks but {header.num_blocks} destination blocks")
        target = self._connect(info, peer)
        handle = TransferHandle(transfer_id)
        with self._lock:
            if self.closing.is_set():
                raise ValueError("sender is closed")
            self._live.add(handle)
        deadline_s = time.monotonic() + self.config.timeout_s
        self._submit(lambda: self._run(handle, target, header, src, deadline_s))
        return handle

    def check_destination(
        self, transfer_id: str, peer: bytes, dst_block_ids: Sequence[int]
    ) -> None:
        """What ``send`` checks before it connects, alone: ValueError naming the problem."""
        self._plan(transfer_id, peer, dst_block_ids)

    def stats(self) -> TransferStats:
        # Count unfinished handles, not ``_live`` (a handle leaves it just after it ends): a
        # nonzero count then means the transfer was still running when it was read.
        with self._lock:
            in_flight = sum(not handle.finished for handle in self._live)
        return replace(self._counters.snapshot(), transfers_in_flight=in_flight)

    def close(self) -> None:
        with self._lock:
            self.closing.set()
            live = list(self._live)
        for handle in live:
            self._finish_failed(handle, "sender closed while the transfer was open")
        # Running jobs see ``closing`` and stop before the backend frees its resources.
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._on_close()

    # Backend hooks ------------------------------------------------------------------------

    def _on_pool_registered(self, pool: torch.Tensor, layout: KVPoolLayout) -> None:
        """Backend setup that needs the pool (e.g. NIXL memory registration)."""

    def _check_fields(self, peer: PeerInfo) -> None:
        """ValueError when the peer's backend fields (address, buffers) are malformed."""

    def _connect(self, peer: PeerInfo, raw: bytes) -> Any:
        """Resolve the peer into whatever ``_transfer`` needs (cached by the backend)."""
        return peer

    def _transfer(
        self,
        handle: TransferHandle,
        target: Any,
        header: TransferHeader,
        src: tuple[int, ...],
        deadline_s: float,
    ) -> None:
        """Move the records by ``deadline_s`` (monotonic); ``handle.start()`` once bytes begin
        to flow; raise on any error."""
        raise NotImplementedError

    def _on_failure(self, target: Any, error: Exception) -> None:
        """Forget cached connection state for a peer after a failed transfer."""

    def _on_close(self) -> None:
        """Release backend resources."""

    # Internals ----------------------------------------------------------------------------

    def _submit(self, job: Callable[[], None]) -> None:
        self._executor.submit(job)

    @property
    def pool(self) -> torch.Tensor:
        assert self._pool is not None, "register_pool() must come before transfers"
        return self._pool

    def _require_layout(self) -> KVPoolLayout:
        if self._layout is None:
            raise ValueError("register_pool(pool) must be called before send()")
        return self._layout

    def _plan(
        self, transfer_id: str, peer: bytes, dst_block_ids: Sequence[int]
    ) -> tuple[PeerInfo, TransferHeader]:
        layout = self._require_layout()
        dst = check_block_ids(dst_block_ids, _ANY_BLOCK, "destination blocks")
        info = decode_peer(peer, self.backend_name)
        # Records in the receiver's pool format: ours, or converted to its (convert.py);
        # int8 records only between float pools.
        converted = converts(layout, info.layout)
        int8 = self.config.int8 and not converted and layout.dtype != torch.int8
        check_peer(layout, info, dst, int8)
        self._check_fields(info)
        wire = info.layout if converted else layout
        header = TransferHeader.for_layout(wire, transfer_id, dst, int8)
        header.encode()  # raises ValueError now on a transfer id the wire cannot carry
        return info, header

    def _run(
        self,
        handle: TransferHandle,
        target: Any,
        header: TransferHeader,
        src: tuple[int, ...],
        deadline_s: float,
    ) -> None:
        try:
            self._transfer(handle, target, header, src, deadline_s)
        except Exception as exc:  # any backend error fails this transfer, and only it
            self._on_failure(target, exc)
            self._finish_failed(handle, f"{type(exc).__name__}: {exc}")
            return
        layout = self._require_layout()
        saved = max(0, header.num_blocks * layout.block_bytes - header.payload_bytes())
        if handle.succeed(header.payload_bytes()):
            self._counters.record_ok(
                sent=header.payload_bytes(), seconds=handle.seconds, saved=saved
            )
        with self._lock:
            self._live.discard(handle)

    def _finish_failed(self, handle: TransferHandle, error: str) -> None:
        if handle.fail(f"transfer {handle.transfer_id!r} failed: {error}"):
            self._counters.record_failed(handle.seconds)
        with self._lock:
            self._live.discard(handle)


class ReceiverBase:
    """Implements ``KVReceiver.expect`` and bookkeeping; backends deliver into the pool."""

    backend_name: ClassVar[str] = ""

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self._counters = TransferCounters()
        self.table = ExpectationTable(config.timeout_s, self._counters)
        self._pool: torch.Tensor | None = None
        self._layout: KVPoolLayout | None = None

    def register_pool(self, pool: torch.Tensor) -> None:
        if self._pool is not None:
            raise ValueError("a KV pool is already registered with this receiver")
        self._layout = KVPoolLayout.of_pool(pool)
        self._pool = pool
        self._on_pool_registered(pool, self._layout)

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int]) -> TransferHandle:
        layout = self.layout
        ids = check_block_ids(dst_block_ids, layout.num_blocks, "destination blocks")
        return self.table.add(transfer_id, ids)

    def stats(self) -> TransferStats:
        return replace(self._counters.snapshot(), transfers_in_flight=len(self.table))

    def close(self) -> None:
        self.table.close()
        self._on_close()

    @property
    def layout(self) -> KVPoolLayout:
        if self._layout is None:
            raise ValueError("register_pool(pool) must be called first")
        return self._layout

    @property
    def pool(self) -> torch.Tensor:
        assert self._pool is not None, "register_pool() must come before transfers"
        return self._pool

    def _on_pool_registered(self, pool: torch.Tensor, layout: KVPoolLayout) -> None:
        """Backend setup that needs the pool (listening socket, NIXL registration)."""

    def _on_close(self) -> None:
        """Release backend resources."""
