"""Moving KV blocks between workers: role-split connector, NIXL/TCP/in-process backends.

Import the light pieces from here; backends come from ``make_sender`` / ``make_receiver``
(``nixl`` is imported only when the NIXL backend is built).
"""

from pdserve.kv_transfer.config import FaultInjection, TransferConfig
from pdserve.kv_transfer.connector import (
    KVReceiver,
    KVSender,
    TransferHandle,
    TransferOutcome,
    TransferState,
)
from pdserve.kv_transfer.factory import BACKENDS, make_receiver, make_sender, nixl_available
from pdserve.kv_transfer.layout import KVPoolLayout
from pdserve.kv_transfer.stats import TransferStats
from pdserve.kv_transfer.wire import TransferHeader, WireFormatError

__all__ = [
    "BACKENDS",
    "FaultInjection",
    "KVPoolLayout",
    "KVReceiver",
    "KVSender",
    "TransferConfig",
    "TransferHandle",
    "TransferHeader",
    "TransferOutcome",
    "TransferState",
    "TransferStats",
    "WireFormatError",
    "make_receiver",
    "make_sender",
    "nixl_available",
]
