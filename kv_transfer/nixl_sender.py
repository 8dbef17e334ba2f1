"""NIXL sender: WRITEs blocks into a receiver's registered pool (see nixl_backend.py); with a
cluster key its notices carry a MAC (notice_mac.py)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.kv_transfer import quant
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.connector import TransferHandle
from pdserve.kv_transfer.convert import CHUNK_BLOCKS, convert_blocks
from pdserve.kv_transfer.endpoints import SenderBase
from pdserve.kv_transfer.handshake import check_auth_settings
from pdserve.kv_transfer.layout import KVPoolLayout
from pdserve.kv_transfer.metadata import PeerInfo
from pdserve.kv_transfer.nixl_agent import (
    NOTIFY_BEGIN,
    NOTIFY_DONE,
    NOTIFY_FAILED,
    Agent,
    memory_segment,
)
from pdserve.kv_transfer.notice_mac import seal_notice
from pdserve.kv_transfer.wire import TransferHeader

log = logging.getLogger(__name__)

_INT8_CHUNK_BLOCKS = 16
_FLUSH_S = 0.05  # long enough for UCX to push a small notification out


@dataclass(slots=True, frozen=True)
class _Peer:
    agent_name: str
    pool_descs: Any  # prepared remote descriptor list, one entry per pool block
    staging_descs: Any | None  # the same for the int8 staging slots, when used
    metadata: bytes  # the receiver's connection metadata these were prepared from


class NixlSender(SenderBase):
    backend_name = "nixl"

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        self._agent = Agent("send", config.ucx_tls, config.nixl_progress_thread)
        self._peers: dict[str, _Peer] = {}
        self._connect_lock = threading.Lock()  # one add_remote per new peer
        self._local_pool: Any = None
        self._local_staging: Any = None
        self._staging: torch.Tensor | None = None  # [num_blocks, record_bytes] uint8
        # Blocks converted to a receiver's pool format (convert.py), one slot per pool block,
        # by that format's dtype: registered at the first transfer that needs it.
        self._converted: dict[torch.dtype, tuple[torch.Tensor, Any]] = {}
        self._convert_lock = threading.Lock()

    def _on_pool_registered(self, pool: torch.Tensor, layout: KVPoolLayout) -> None:
        segment = memory_segment(pool)
        if segment[0] == "VRAM" and self.config.int8:
            raise ValueError(
                "int8 KV transfer quantizes on the host: with a pool on a GPU use the plain "
                "format over NIXL, or the TCP backend"
            )
        self._agent.register(pool)
        n = layout.num_blocks
        self._local_pool = self._agent.prep_blocks(
            "", pool.data_ptr(), n, layout.block_bytes, segment
        )
        if self.config.int8:
            rec = quant.record_bytes(layout)
            self._staging = torch.empty((n, rec), dtype=torch.uint8)
            self._agent.register(self._staging)
            self._local_staging = self._agent.prep_blocks("", self._staging.data_ptr(), n, rec)

    def check_destination(
        self, transfer_id: str, peer: bytes, dst_block_ids: Sequence[int]
    ) -> None:
        """Also loads the peer's agent metadata (NIXL connects lazily: nothing is sent),
        so metadata NIXL refuses is refused here too."""
        info, _ = self._plan(transfer_id, peer, dst_block_ids)
        self._connect(info, peer)

    def _connect(self, peer: PeerInfo, raw: bytes) -> _Peer:
        check_auth_settings(peer.auth, self.config.auth_key)
        name = str(peer.fields["agent"])
        with self._connect_lock:
            known = self._peers.get(name)
            if known is None:
                known = self._add_peer(name, peer, raw)
                self._peers[name] = known
            elif known.metadata != raw:  # an agent's metadata never changes
                raise ValueError(
                    f"peer metadata names NIXL agent {name!r} but differs from that agent's"
                )
            return known

    def _check_fields(self, peer: PeerInfo) -> None:
        fields = peer.fields
        addresses = ("pool_addr", "staging_addr") if peer.int8 else ("pool_addr",)
        if not isinstance(fields.get("agent"), str) or not all(
            type(fields.get(a)) is int for a in addresses
        ):
            raise ValueError(
                f"peer metadata needs a NIXL agent name and buffer addresses {addresses}, got "
                f"{fields!r:.200}"
            )
        _pool_segment(fields)

    def _add_peer(self, name: str, peer: PeerInfo, raw: bytes) -> _Peer:
        """Load the peer's agent metadata and prepare its blocks; ValueError when NIXL
        refuses them (not a NIXL agent's metadata, or buffers the peer never registered:
        NIXL checks every remote block against the peer's registered memory)."""
        try:
            remote = self._agent.add_remote(peer.blob)
        except Exception as exc:  # nixl raises its own binding error types
            raise ValueError(f"peer agent metadata refused by NIXL: {exc!r}") from exc
        try:
            if remote != name:
                raise ValueError(f"peer NIXL metadata names agent {remote!r}, fields say {name!r}")
            return self._prep_peer(name, peer, raw)
        except Exception as exc:
            if remote not in self._peers:  # a known peer's connection stays in use
                self._agent.remove_remote(remote)
            if isinstance(exc, ValueError):
                raise
            raise ValueError(f"peer buffers refused by NIXL: {exc!r}") from exc

    def _prep_peer(self, name: str, peer: PeerInfo, raw: bytes) -> _Peer:
        layout, fields = peer.layout, peer.fields
        segment = _pool_segment(fields)
        pool_descs = self._agent.prep_blocks(
            name, fields["pool_addr"], layout.num_blocks, layout.block_bytes, segment
        )
        staging = None
        if peer.int8:
            staging = self._agent.prep_blocks(
                name, fields["staging_addr"], layout.num_blocks, quant.record_bytes(layout)
            )
        return _Peer(name, pool_descs, staging, raw)

    def _on_failure(self, target: _Peer, error: Exception) -> None:
        if isinstance(error, TimeoutError):
            return  # slow, not known dead: keep the connection other transfers may be using
        # The connection may be dead; the next send re-adds the peer from its metadata.
        with self._connect_lock:
            if self._peers.pop(target.agent_name, None) is not None:
                self._agent.remove_remote(target.agent_name)

    def _on_close(self) -> None:
        self._agent.close()

    def _transfer(
        self,
        handle: TransferHandle,
        target: _Peer,
        header: TransferHeader,
        src: tuple[int, ...],
        deadline_s: float,
    ) -> None:
        wire_header = header.encode()

        def notice(kind: bytes) -> bytes:
            return seal_notice(self.config.auth_key, target.agent_name, kind + wire_header)

        self._agent.notify(target.agent_name, notice(NOTIFY_BEGIN))
        handle.start()
        try:
            self._write(target, header, src, deadline_s, notice(NOTIFY_DONE))
        except Exception:
            self._notify_quietly(target.agent_name, notice(NOTIFY_FAILED))
            raise

    def _write(
        self,
        target: _Peer,
        header: TransferHeader,
        src: tuple[int, ...],
        deadline_s: float,
        done_message: bytes,
    ) -> None:
        local, remote = self._local_pool, target.pool_descs
        if header.int8:
            self._quantize_into_staging(src)
            local, remote = self._local_staging, target.staging_descs
        elif header.dtype != self.pool.dtype:
            local = self._convert_into_staging(src, header)
        dst = header.dst_block_ids
        for lo, hi in self._segments(len(src)):
            if self.closing.is_set():
                raise ConnectionAbortedError("sender closing")
            last = hi == len(src)
            with self._agent.lock:
                xfer = self._agent.raw.make_prepped_xfer(
                    "WRITE", local, list(src[lo:hi]), remote, list(dst[lo:hi]),
                    done_message if last else b"",
                )  # fmt: skip
                status = self._agent.raw.transfer(xfer)
            try:
                if status == "ERR":
                    raise ConnectionError("NIXL refused to post the write")
                self._agent.wait_xfer(xfer, deadline_s, self.closing)
            finally:
                self._agent.release_xfer(xfer)
            if not last and self.config.fault is not None:
                self.closing.wait(self.config.fault.pause_s)

    def _segments(self, n: int) -> list[tuple[int, int]]:
        """One request for the whole transfer, or two around an injected pause."""
        fault = self.config.fault
        if fault is None or not 0 < fault.pause_after_blocks < n:
            return [(0, n)]
        return [(0, fault.pause_after_blocks), (fault.pause_after_blocks, n)]

    def _quantize_into_staging(self, src: tuple[int, ...]) -> None:
        # Concurrent transfers of one source block write identical bytes to its slot.
        assert self._staging is not None, "int8 sender has a staging area"
        layout = KVPoolLayout.of_pool(self.pool)
        for start in range(0, len(src), _INT8_CHUNK_BLOCKS):
            index = torch.tensor(src[start : start + _INT8_CHUNK_BLOCKS], dtype=torch.long)
            records = quant.encode_records(self.pool.index_select(0, index), layout)
            self._staging.index_copy_(0, index, records)

    def _convert_into_staging(self, src: tuple[int, ...], header: TransferHeader) -> Any:
        """The source blocks in the receiver's pool format, each in its own slot; returns the
        slots' descriptors. Concurrent transfers of one block write identical bytes."""
        layout = header.layout(self._require_layout().num_blocks)
        with self._convert_lock:
            found = self._converted.get(layout.dtype)
            if found is None:
                slots = torch.empty((layout.num_blocks, layout.block_bytes), dtype=torch.uint8)
                self._agent.register(slots)
                descs = self._agent.prep_blocks(
                    "", slots.data_ptr(), layout.num_blocks, layout.block_bytes
                )
                found = self._converted[layout.dtype] = (slots, descs)
        slots, descs = found
        for start in range(0, len(src), CHUNK_BLOCKS):
            index = torch.tensor(src[start : start + CHUNK_BLOCKS], dtype=torch.long)
            blocks = convert_blocks(self.pool.index_select(0, index), layout)
            slots.index_copy_(0, index, blocks.view(torch.uint8).reshape(len(index), -1))
        return descs

    def _notify_quietly(self, agent_name: str, message: bytes) -> None:
        try:
            self._agent.notify(agent_name, message)
            self._agent.flush(_FLUSH_S)
        except Exception as exc:  # the peer is likely gone; its deadline covers it
            log.info("NIXL failure notice to %s not sent: %s", agent_name, exc)


def _pool_segment(fields: dict[str, object]) -> tuple[str, int]:
    """The receiver pool's NIXL memory segment (kind, device id); ValueError on anything
    else. A receiver that names none has its pool in host memory."""
    kind, device_id = fields.get("pool_segment", "DRAM"), fields.get("pool_device", 0)
    if kind not in ("DRAM", "VRAM") or type(device_id) is not int or device_id < 0:
        raise ValueError(
            f"peer pool segment must be DRAM or VRAM with a device id >= 0, got "
            f"{kind!r:.20} {device_id!r:.20}"
        )
    return str(kind), device_id
