"""NIXL receiver: exposes its registered pool and turns notifications into handle states.

One poller thread reads NIXL notifications (see nixl_backend.py for the messages). With a
cluster key a notice without a valid MAC is refused before anything else (notice_mac.py).
A message that arrives before ``expect`` is kept until its transfer is expected or the
timeout passes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import torch

from pdserve.kv_transfer import quant
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.connector import TransferHandle
from pdserve.kv_transfer.endpoints import ReceiverBase
from pdserve.kv_transfer.expectations import Expectation
from pdserve.kv_transfer.layout import KVPoolLayout
from pdserve.kv_transfer.metadata import PeerInfo, encode_peer
from pdserve.kv_transfer.nixl_agent import (
    NOTIFY_BEGIN,
    NOTIFY_DONE,
    NOTIFY_FAILED,
    Agent,
    memory_segment,
)
from pdserve.kv_transfer.notice_mac import NoticeRefused, open_notice
from pdserve.kv_transfer.wire import TransferHeader, validate_header

log = logging.getLogger(__name__)

_BUSY_POLL_S = 0.0005  # while transfers are expected: notification latency <= 0.5 ms
_IDLE_POLL_S = 0.01
# Notices held for transfers not expected yet: bounded, so a flood of notices naming
# unknown transfers cannot grow memory until their timeout. A real transfer sends 2.
_MAX_EARLY_TRANSFERS = 1024
_MAX_EARLY_NOTICES_PER_TRANSFER = 4


class NixlReceiver(ReceiverBase):
    backend_name = "nixl"

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        self._agent = Agent("recv", config.ucx_tls, config.nixl_progress_thread)
        self._staging: torch.Tensor | None = None  # [num_blocks, record_bytes] uint8
        self._metadata = b""
        # transfer id -> [(arrival time, kind, header)] for messages that beat expect().
        self._early: dict[str, list[tuple[float, bytes, TransferHeader]]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_forever, name="kv-nixl-recv", daemon=True)

    def _on_pool_registered(self, pool: torch.Tensor, layout: KVPoolLayout) -> None:
        self._agent.register(pool)
        fields: dict[str, object] = {"agent": self._agent.name, "pool_addr": pool.data_ptr()}
        fields["pool_segment"], fields["pool_device"] = memory_segment(pool)
        # An int8 pool's blocks come as they are; int8 records dequantize on the host, so a
        # pool on a GPU takes plain blocks only.
        int8 = self.config.int8 and layout.dtype != torch.int8 and fields["pool_segment"] == "DRAM"
        if int8:
            self._staging = torch.empty(
                (layout.num_blocks, quant.record_bytes(layout)), dtype=torch.uint8
            )
            self._agent.register(self._staging)
            fields["staging_addr"] = self._staging.data_ptr()
        auth = self.config.auth_key is not None
        info = PeerInfo(self.backend_name, layout, int8, fields, self._agent.metadata(), auth)
        self._metadata = encode_peer(info)
        self._poller.start()

    def connection_metadata(self) -> bytes:
        if not self._metadata:
            raise ValueError("register_pool(pool) must be called before connection_metadata()")
        return self._metadata

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int]) -> TransferHandle:
        handle = super().expect(transfer_id, dst_block_ids)
        self._wake.set()  # switch the poller to busy polling now
        return handle

    def _on_close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._poller.is_alive():
            self._poller.join(timeout=2.0)
        self._agent.close()

    def _poll_forever(self) -> None:
        while not self._stop.is_set():
            for messages in self._agent.new_notifs().values():
                for message in messages:
                    self._on_message(message)
            self._replay_early()
            busy = len(self.table) > 0 or bool(self._early)
            self._wake.wait(_BUSY_POLL_S if busy else _IDLE_POLL_S)
            self._wake.clear()

    def _on_message(self, message: bytes) -> None:
        if not message:
            return  # a write segment without a notification
        try:
            notice = open_notice(self.config.auth_key, self._agent.name, message)
        except NoticeRefused as exc:
            log.warning("NIXL receiver refused a notice: %s", exc)
            self._counters.record_refused()
            return
        kind = notice[:1]
        try:
            header = TransferHeader.decode(notice[1:])
        except ValueError as exc:
            log.warning("NIXL receiver dropped a bad notification: %s", exc)
            self._counters.record_failed(0.0)
            return
        exp = self.table.get(header.transfer_id)
        if exp is not None:
            self._apply(kind, header, exp)
        elif self.table.recently_ended(header.transfer_id):
            log.info("late %r notice for ended transfer %r dropped", kind, header.transfer_id)
        else:
            self._keep_early(kind, header)

    def _keep_early(self, kind: bytes, header: TransferHeader) -> None:
        held = self._early.get(header.transfer_id)
        if (held is None and len(self._early) >= _MAX_EARLY_TRANSFERS) or (
            held is not None and len(held) >= _MAX_EARLY_NOTICES_PER_TRANSFER
        ):
            tid = header.transfer_id
            log.warning("NIXL notice %r for unexpected transfer %r dropped", kind, tid)
            self._counters.record_failed(0.0)
            return
        arrival = (time.monotonic(), kind, header)
        self._early.setdefault(header.transfer_id, []).append(arrival)

    def _replay_early(self) -> None:
        now = time.monotonic()
        for transfer_id in list(self._early):
            exp = self.table.get(transfer_id)
            messages = self._early[transfer_id]
            if exp is not None:
                del self._early[transfer_id]
                for _, kind, header in messages:
                    self._apply(kind, header, exp)
            elif now - messages[0][0] > self.config.timeout_s:
                del self._early[transfer_id]
                log.warning("NIXL transfer %r arrived but was never expected", transfer_id)

    def _apply(self, kind: bytes, header: TransferHeader, exp: Expectation) -> None:
        tid = header.transfer_id
        if kind == NOTIFY_BEGIN:
            self.table.start(exp, claim=False)
        elif kind == NOTIFY_FAILED:
            self.table.fail(exp, f"sender gave up on transfer {tid!r} (see its error)")
        elif kind == NOTIFY_DONE:
            self._complete(header, exp)
        else:
            self.table.fail(exp, f"transfer {tid!r}: unknown NIXL notification kind {kind!r}")

    def _complete(self, header: TransferHeader, exp: Expectation) -> None:
        try:
            validate_header(header, self.layout, exp.dst_block_ids)
            if header.int8 and self._staging is None:
                raise ValueError(
                    f"transfer {header.transfer_id!r} sent int8 records but this receiver "
                    "has no int8 staging area (TransferConfig.int8=False)"
                )
        except ValueError as exc:
            self.table.fail(exp, str(exc))
            return
        self.table.start(exp, claim=False)  # no-op when the begin notice came first
        saved = 0
        if header.int8:
            assert self._staging is not None
            index = torch.tensor(exp.dst_block_ids, dtype=torch.long)
            records = self._staging.index_select(0, index)  # [n, record_bytes]
            quant.decode_records_into(records, self.pool, list(exp.dst_block_ids), self.layout)
            saved = quant.bytes_saved(self.layout, header.num_blocks)
        self.table.succeed(exp, header.payload_bytes(), saved)
