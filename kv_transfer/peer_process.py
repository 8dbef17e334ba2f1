"""Run KV endpoints in another process (multiprocessing spawn) and drive them over a pipe.

For the multi-process conformance and fault tests and the benchmark: a child hosts one or
more endpoints (each with its own pool), the parent calls ``expect``/``send``/``wait``
and reads pool blocks back. ``LocalPeer`` offers the same calls in-process (for the
in-process backend, whose endpoints must share a process).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdserve.kv_codec import quantize_rows
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.connector import KVReceiver, KVSender, TransferHandle, TransferOutcome
from pdserve.kv_transfer.factory import make_receiver, make_sender
from pdserve.kv_transfer.layout import KVPoolLayout
from pdserve.kv_transfer.stats import TransferStats


@dataclass(slots=True, frozen=True)
class EndpointSpec:
    backend: str
    role: str  # "sender" or "receiver"
    layout: KVPoolLayout
    config: TransferConfig
    seed: int | None = None  # pool = seeded normal values; None = zeros


def make_pool(layout: KVPoolLayout, seed: int | None) -> torch.Tensor:
    """pool: [num_blocks, num_layers, 2, block_size, kv_heads, row], reproducible (an int8
    pool: normal values as its rows)."""
    if seed is None:
        return torch.zeros(layout.pool_shape, dtype=layout.dtype)
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn((layout.num_blocks, *layout.block_shape), generator=gen)
    return quantize_rows(values) if layout.dtype == torch.int8 else values.to(layout.dtype)


class _Host:
    """The endpoints of one process and the commands they answer."""

    def __init__(self, specs: Sequence[EndpointSpec]) -> None:
        self.pools = [make_pool(s.layout, s.seed) for s in specs]
        self.endpoints: list[KVSender | KVReceiver] = []
        for spec, pool in zip(specs, self.pools, strict=True):
            if spec.role not in ("sender", "receiver"):
                raise ValueError(f"role must be 'sender' or 'receiver', got {spec.role!r}")
            make = make_sender if spec.role == "sender" else make_receiver
            endpoint: KVSender | KVReceiver = make(spec.backend, spec.config)
            endpoint.register_pool(pool)
            self.endpoints.append(endpoint)
        self.handles: dict[str, TransferHandle] = {}

    def metadata(self) -> list[bytes]:
        return [
            e.connection_metadata() if isinstance(e, KVReceiver) else b"" for e in self.endpoints
        ]

    def run(self, cmd: str, slot: int, args: tuple[Any, ...]) -> Any:
        endpoint = self.endpoints[slot]
        if cmd == "expect":
            assert isinstance(endpoint, KVReceiver), f"slot {slot} is not a receiver"
            self.handles[args[0]] = endpoint.expect(*args)
        elif cmd == "send":
            assert isinstance(endpoint, KVSender), f"slot {slot} is not a sender"
            self.handles[args[0]] = endpoint.send(*args)
        elif cmd == "wait":
            self.handles[args[0]].wait(args[1])
            return self.handles[args[0]].outcome()
        elif cmd == "outcome":
            return self.handles[args[0]].outcome()
        elif cmd == "blocks":
            return self.pools[slot][list(args[0])].clone()
        elif cmd == "stats":
            return endpoint.stats()
        else:
            raise ValueError(f"unknown peer command {cmd!r}")
        return None

    def close(self) -> None:
        for endpoint in self.endpoints:
            endpoint.close()


def _child_main(specs: Sequence[EndpointSpec], conn: Connection) -> None:
    host = _Host(specs)
    conn.send(("ready", host.metadata()))
    while True:
        cmd, slot, args = conn.recv()
        if cmd == "close":
            host.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", host.run(cmd, slot, args)))
        except Exception as exc:  # reported to the parent, which raises it there
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class _PeerCalls:
    """Typed calls shared by ``PeerProcess`` and ``LocalPeer``."""

    metadata: list[bytes]

    def call(self, cmd: str, slot: int, *args: Any, timeout_s: float = 60.0) -> Any:
        raise NotImplementedError

    def expect(self, slot: int, transfer_id: str, dst: Sequence[int]) -> None:
        self.call("expect", slot, transfer_id, list(dst))

    def send(
        self, slot: int, transfer_id: str, src: Sequence[int], peer: bytes, dst: Sequence[int]
    ) -> None:
        self.call("send", slot, transfer_id, list(src), peer, list(dst))

    def wait(self, transfer_id: str, timeout_s: float) -> TransferOutcome:
        outcome: TransferOutcome = self.call(
            "wait", 0, transfer_id, timeout_s, timeout_s=timeout_s + 30
        )
        return outcome

    def outcome(self, transfer_id: str) -> TransferOutcome:
        outcome: TransferOutcome = self.call("outcome", 0, transfer_id)
        return outcome

    def blocks(self, slot: int, block_ids: Sequence[int]) -> torch.Tensor:
        blocks: torch.Tensor = self.call("blocks", slot, list(block_ids))
        return blocks

    def stats(self, slot: int) -> TransferStats:
        stats: TransferStats = self.call("stats", slot)
        return stats


class PeerProcess(_PeerCalls):
    """Endpoints in a spawned child process."""

    def __init__(self, specs: Sequence[EndpointSpec], start_timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_child_main, args=(tuple(specs), child_conn), daemon=True)
        self.process.start()
        child_conn.close()
        if not self._conn.poll(start_timeout_s):
            self.kill()
            raise TimeoutError(f"KV peer process did not start within {start_timeout_s}s")
        _, self.metadata = self._conn.recv()

    def call(self, cmd: str, slot: int, *args: Any, timeout_s: float = 60.0) -> Any:
        self._conn.send((cmd, slot, args))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"KV peer did not answer {cmd!r} within {timeout_s}s")
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"KV peer failed {cmd!r}: {value}")
        return value

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("close", 0, timeout_s=10)
            except (OSError, EOFError, TimeoutError, RuntimeError):
                self.kill()
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.kill()


class LocalPeer(_PeerCalls):
    """The same calls on endpoints in this process."""

    def __init__(self, specs: Sequence[EndpointSpec]) -> None:
        self._host = _Host(specs)
        self.metadata = self._host.metadata()

    def call(self, cmd: str, slot: int, *args: Any, timeout_s: float = 60.0) -> Any:
        return self._host.run(cmd, slot, args)

    def close(self) -> None:
        self._host.close()
