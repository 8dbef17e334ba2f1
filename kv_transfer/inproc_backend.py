"""In-process backend: a tensor copy between two pools of one process.

Serves tests and benchmarks (bench/int8_effect.py). ``send`` runs the copy on the caller's thread,
so the returned handle has already ended. The receiver must ``expect`` before the sender sends.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Callable

import torch

from pdserve.kv_transfer import quant
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.connector import TransferHandle
from pdserve.kv_transfer.convert import convert_blocks
from pdserve.kv_transfer.endpoints import ReceiverBase, SenderBase
from pdserve.kv_transfer.metadata import PeerInfo, encode_peer
from pdserve.kv_transfer.wire import TransferHeader, validate_header

_RECEIVERS: weakref.WeakValueDictionary[str, InprocReceiver] = weakref.WeakValueDictionary()


class InprocSender(SenderBase):
    backend_name = "inproc"

    def _connect(self, peer: PeerInfo, raw: bytes) -> InprocReceiver:
        key = str(peer.fields.get("key"))
        receiver = _RECEIVERS.get(key)
        if receiver is None:
            raise ValueError(f"in-process receiver {key!r} is gone (closed?)")
        return receiver

    def _submit(self, job: Callable[[], None]) -> None:
        job()

    def _transfer(
        self,
        handle: TransferHandle,
        target: InprocReceiver,
        header: TransferHeader,
        src: tuple[int, ...],
        deadline_s: float,
    ) -> None:
        handle.start()
        blocks = self.pool.index_select(0, torch.tensor(src, dtype=torch.long))
        if not header.int8 and header.dtype != self.pool.dtype:
            blocks = convert_blocks(blocks, header.layout(len(src)))  # the receiver's format
        target.accept(header, blocks)


class InprocReceiver(ReceiverBase):
    backend_name = "inproc"

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        self._key = uuid.uuid4().hex
        _RECEIVERS[self._key] = self

    def connection_metadata(self) -> bytes:
        return encode_peer(PeerInfo(self.backend_name, self.layout, True, {"key": self._key}))

    def accept(self, header: TransferHeader, blocks: torch.Tensor) -> None:
        """Copy the sender's ``blocks`` (``[n, *pool block]``, in this pool's format unless
        ``header.int8``) into the expected destination blocks; raise on mismatch."""
        exp = self.table.get(header.transfer_id)
        if exp is None:
            raise ValueError(f"receiver has no expect() for transfer {header.transfer_id!r}")
        try:
            validate_header(header, self.layout, exp.dst_block_ids)
        except ValueError as exc:
            self.table.fail(exp, str(exc))
            raise
        if not self.table.start(exp, claim=True):
            raise ValueError(f"transfer {header.transfer_id!r} already ended: {exp.handle.error}")
        if header.int8:
            records = quant.encode_records(blocks, self.layout)
            quant.decode_records_into(records, self.pool, list(exp.dst_block_ids), self.layout)
        else:
            dst_index = torch.tensor(exp.dst_block_ids, dtype=torch.long)
            self.pool.index_copy_(0, dst_index, blocks)
        saved = quant.bytes_saved(self.layout, header.num_blocks) if header.int8 else 0
        self.table.succeed(exp, header.payload_bytes(), saved)

    def _on_close(self) -> None:
        _RECEIVERS.pop(self._key, None)
