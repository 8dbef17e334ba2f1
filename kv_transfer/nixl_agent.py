"""Thin, lazily imported wrapper over the ``nixl`` package: agent creation and descriptors.

Nothing here imports ``nixl`` at module import time: ``load_nixl`` does, with a clear error
when the package (or its UCX plugin) is missing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from types import ModuleType
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

NOTIFY_BEGIN = b"B"  # the sender starts writing
NOTIFY_DONE = b"D"  # all records landed; the header follows
NOTIFY_FAILED = b"F"  # the sender gave up; the header follows


def load_nixl() -> ModuleType:
    """The ``nixl._api`` module; ImportError naming the fix if it is not installed."""
    try:
        from nixl import _api
    except ImportError as exc:
        raise ImportError(
            "KV transfer backend 'nixl' needs the 'nixl' package (pip install nixl); "
            f"it failed to import ({exc}). Use backend 'tcp' where NIXL is unavailable."
        ) from exc
    return _api


def memory_segment(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory kind and device id for ``tensor``: ("VRAM", gpu) or ("DRAM", 0)."""
    if tensor.device.type == "cuda":
        index = tensor.device.index
        return "VRAM", torch.cuda.current_device() if index is None else index
    return "DRAM", 0


class Agent:
    """A NIXL agent with the UCX backend, serialized by one lock (NIXL calls are not
    thread-safe in its default sync mode, and senders call it from several threads)."""

    def __init__(self, role: str, ucx_tls: str, progress_thread: bool = False) -> None:
        # UCX reads UCX_TLS when the backend starts; respect an explicit setting.
        os.environ.setdefault("UCX_TLS", ucx_tls)
        api = load_nixl()
        self.name = f"pdkv-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.lock = threading.Lock()
        try:
            # No listener thread: it would hand this agent's metadata (UCX address, memory
            # keys) to whoever asks on its port. The metadata leaves only inside the worker
            # API (ReserveKV's answer), under mutual TLS in a cluster with a secret.
            config = api.nixl_agent_config(
                enable_prog_thread=progress_thread, enable_listen_thread=False, backends=["UCX"]
            )
            self.raw = api.nixl_agent(self.name, config)
        except Exception as exc:  # nixl raises its own binding error types
            raise RuntimeError(
                f"NIXL UCX backend failed to start with UCX_TLS={os.environ['UCX_TLS']!r} "
                f"(it needs 'tcp' on this machine): {exc}"
            ) from exc
        if "UCX" not in self.raw.backends:
            raise RuntimeError("NIXL has no UCX plugin; reinstall nixl or use backend 'tcp'")
        self._registered: list[Any] = []

    def register(self, tensor: torch.Tensor) -> None:
        """Register one contiguous tensor with UCX (once, for the agent's life): host memory
        as DRAM, a GPU's as VRAM (which needs a UCX built with CUDA support)."""
        segment, _ = memory_segment(tensor)
        with self.lock:
            try:
                self._registered.append(self.raw.register_memory(tensor))
            except Exception as exc:  # nixl raises its own binding error types
                if segment != "VRAM":
                    raise
                raise RuntimeError(
                    f"NIXL could not register GPU memory on {tensor.device} (its UCX may lack "
                    f"CUDA support): {exc}; use --kv-backend tcp, which stages GPU blocks "
                    "through pinned host memory"
                ) from exc

    def prep_blocks(
        self,
        agent_name: str,
        base_addr: int,
        count: int,
        nbytes: int,
        segment: tuple[str, int] = ("DRAM", 0),
    ) -> Any:
        """A prepared descriptor list: entry i is bytes [base + i*nbytes, +nbytes) of the
        memory ``segment`` (kind and device id, see :func:`memory_segment`)."""
        kind, device_id = segment
        descs = np.zeros((count, 3), dtype=np.uint64)  # (address, length, device id)
        descs[:, 0] = base_addr + np.arange(count, dtype=np.uint64) * np.uint64(nbytes)
        descs[:, 1] = nbytes
        descs[:, 2] = device_id
        with self.lock:
            return self.raw.prep_xfer_dlist(agent_name, descs, kind)

    def wait_xfer(
        self, xfer: Any, deadline_s: float, cancel: threading.Event | None = None
    ) -> None:
        """Poll a posted transfer until DONE; raise on error, at the deadline or on cancel."""
        sleep_s = 20e-6
        while True:
            if cancel is not None and cancel.is_set():
                raise ConnectionAbortedError("sender closing")
            with self.lock:
                state = self.raw.check_xfer_state(xfer)
            if state == "DONE":
                return
            if state == "ERR":
                raise ConnectionError("NIXL reported a transfer error (peer gone?)")
            if time.monotonic() > deadline_s:
                raise TimeoutError("NIXL write did not complete by the transfer deadline")
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, 1e-3)

    def release_xfer(self, xfer: Any) -> None:
        """Release (and so cancel, if still running) a transfer request."""
        try:
            with self.lock:
                xfer.release()
        except Exception as exc:  # a failed cancel leaves the handle to nixl's leak list
            log.warning("NIXL could not release transfer %r: %s", xfer, exc)

    def notify(self, agent_name: str, message: bytes) -> None:
        with self.lock:
            self.raw.send_notif(agent_name, message)

    def flush(self, seconds: float) -> None:
        """Drive UCX for a while so queued notifications leave: without a progress thread
        nothing else moves them when no transfer is being polled."""
        deadline_s = time.monotonic() + seconds
        while time.monotonic() < deadline_s:
            self.new_notifs()
            time.sleep(0.001)

    def new_notifs(self) -> dict[str, list[bytes]]:
        with self.lock:
            result: dict[str, list[bytes]] = self.raw.get_new_notifs()
            return result

    def metadata(self) -> bytes:
        with self.lock:
            data: bytes = self.raw.get_agent_metadata()
            return data

    def add_remote(self, metadata: bytes) -> str:
        with self.lock:
            name = self.raw.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, agent_name: str) -> None:
        try:
            with self.lock:
                self.raw.remove_remote_agent(agent_name)
        except Exception as exc:  # already disconnected: nothing left to remove
            log.info("NIXL remove_remote_agent(%s): %s", agent_name, exc)

    def close(self) -> None:
        with self.lock:
            for descs in self._registered:
                self.raw.deregister_memory(descs)
            self._registered.clear()
