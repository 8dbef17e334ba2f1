"""Build a sender or receiver by backend name; heavy backends are imported only here."""

from __future__ import annotations

from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.connector import KVReceiver, KVSender

BACKENDS = ("nixl", "tcp", "inproc")


def make_sender(backend: str, config: TransferConfig | None = None) -> KVSender:
    """A ``KVSender`` for ``backend`` (one of BACKENDS). ImportError if nixl is missing."""
    config = config or TransferConfig()
    if backend == "nixl":
        from pdserve.kv_transfer.nixl_sender import NixlSender

        return NixlSender(config)
    if backend == "tcp":
        from pdserve.kv_transfer.tcp_backend import TcpSender

        return TcpSender(config)
    if backend == "inproc":
        from pdserve.kv_transfer.inproc_backend import InprocSender

        return InprocSender(config)
    raise ValueError(f"unknown KV transfer backend {backend!r}; choose one of {BACKENDS}")


def make_receiver(backend: str, config: TransferConfig | None = None) -> KVReceiver:
    """A ``KVReceiver`` for ``backend`` (one of BACKENDS). ImportError if nixl is missing."""
    config = config or TransferConfig()
    if backend == "nixl":
        from pdserve.kv_transfer.nixl_receiver import NixlReceiver

        return NixlReceiver(config)
    if backend == "tcp":
        from pdserve.kv_transfer.tcp_backend import TcpReceiver

        return TcpReceiver(config)
    if backend == "inproc":
        from pdserve.kv_transfer.inproc_backend import InprocReceiver

        return InprocReceiver(config)
    raise ValueError(f"unknown KV transfer backend {backend!r}; choose one of {BACKENDS}")


def nixl_available() -> bool:
    """Whether the nixl package imports (for choosing 'nixl' vs the 'tcp' fallback)."""
    from pdserve.kv_transfer.nixl_agent import load_nixl

    try:
        load_nixl()
    except ImportError:
        return False
    return True
