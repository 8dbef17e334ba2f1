"""KV transfer throughput between two processes: NIXL, TCP, and a raw one-descriptor NIXL copy.

Method: a child process hosts the receivers (zeroed pools); this process sends. The KV of
a prompt of T tokens is T/16 blocks of the default model's shape (30 layers, 3 KV heads,
head_dim 64, block 16). Source and destination block ids are random permutations (a
fragmented pool, the realistic case). Each (method, dtype, size) runs once as warm-up,
then ``--repeats`` times; the table shows the median and the best run (on a shared, busy
machine the best run is the better estimate of what the path can do). Time is from
``send`` until the sender's handle is DONE (for TCP that includes the receiver's ack; for
NIXL, the write's completion). The reference is one NIXL WRITE of the same number of
bytes as a single contiguous descriptor between the same two registered pools. GB/s counts
the KV bytes in the pool dtype (so int8 rows, with ``--int8``, show the effective rate).
The first blocks of every run are checked against the sent ones.

    .venv/bin/python -m pdserve.bench.kv_transfer [--tokens 2048 8192] [--repeats 5] [--int8]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kv_transfer import KVPoolLayout, KVSender, TransferConfig, TransferState, make_sender
from pdserve.kv_transfer.metadata import decode_peer
from pdserve.kv_transfer.nixl_agent import Agent
from pdserve.kv_transfer.peer_process import EndpointSpec, PeerProcess, make_pool

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TIMEOUT_S = 120.0


@dataclass(slots=True, frozen=True)
class Row:
    dtype: str
    tokens: int
    method: str
    kv_bytes: int
    samples_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def best_s(self) -> float:
        return min(self.samples_s)

    @property
    def gb_per_s(self) -> float:
        return self.kv_bytes / self.median_s / 1e9

    @property
    def best_gb_per_s(self) -> float:
        return self.kv_bytes / self.best_s / 1e9


@dataclass(slots=True)
class Side:
    """One dtype's senders (this process) and receiver peers (child processes)."""

    layout: KVPoolLayout
    pool: torch.Tensor
    senders: dict[str, KVSender]
    peers: dict[str, tuple[PeerProcess, int]]  # method -> (peer, endpoint slot)
    raw_agent: Agent  # a plain NIXL agent with ``pool`` registered, for the reference


def _layout(num_blocks: int, dtype: torch.dtype) -> KVPoolLayout:
    return KVPoolLayout(num_blocks, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)


def _timed(run: Callable[[], float], repeats: int) -> tuple[float, ...]:
    run()  # warm-up: connection setup, first-touch of pages
    return tuple(run() for _ in range(repeats))


def _kv_run(side: Side, method: str, n: int, rng: np.random.Generator) -> Callable[[], float]:
    sender = side.senders[method]
    peer, slot = side.peers[method]

    def run() -> float:
        src = rng.permutation(side.layout.num_blocks)[:n].tolist()
        dst = rng.permutation(side.layout.num_blocks)[:n].tolist()
        tid = f"bench-{uuid.uuid4().hex[:12]}"
        peer.expect(slot, tid, dst)
        handle = sender.send(tid, src, peer.metadata[slot], dst)
        state = handle.wait(TIMEOUT_S)
        assert state is TransferState.DONE, f"{method}: {handle.error}"
        assert peer.wait(tid, TIMEOUT_S).state is TransferState.DONE
        _check_blocks(side, method, src[:2], dst[:2])
        return handle.seconds

    return run


def _check_blocks(side: Side, method: str, src: list[int], dst: list[int]) -> None:
    peer, slot = side.peers[method]
    got = peer.blocks(slot, dst)
    if method.endswith("int8"):
        ok = torch.allclose(got.float(), side.pool[src].float(), atol=0.05, rtol=0.02)
    else:
        ok = torch.equal(got.view(torch.uint8), side.pool[src].view(torch.uint8))
    assert ok, f"{method}: received blocks differ from the sent ones"


def _raw_run(side: Side, n: int) -> Callable[[], float]:
    """One WRITE of n blocks' bytes as ONE descriptor, pool to pool, via a fresh agent."""
    peer, slot = side.peers["nixl"]
    info = decode_peer(peer.metadata[slot], "nixl")
    agent = side.raw_agent
    nbytes = n * side.layout.block_bytes
    remote_name = agent.add_remote(info.blob)
    local = agent.prep_blocks("", side.pool.data_ptr(), 1, nbytes)
    remote = agent.prep_blocks(remote_name, int(info.fields["pool_addr"]), 1, nbytes)

    def run() -> float:
        start = time.perf_counter()
        with agent.lock:
            xfer = agent.raw.make_prepped_xfer("WRITE", local, [0], remote, [0], b"")
            status = agent.raw.transfer(xfer)
        assert status != "ERR", "raw NIXL write refused"
        agent.wait_xfer(xfer, time.monotonic() + TIMEOUT_S)
        elapsed = time.perf_counter() - start
        agent.release_xfer(xfer)
        return elapsed

    return run


def _build_side(dtype: torch.dtype, num_blocks: int, int8: bool) -> Side:
    layout = _layout(num_blocks, dtype)
    pool = make_pool(layout, seed=0)
    senders: dict[str, KVSender] = {}
    peers: dict[str, tuple[PeerProcess, int]] = {}
    for backend in ("nixl", "tcp"):
        recv_config = TransferConfig(timeout_s=TIMEOUT_S, int8=int8)
        peer = PeerProcess([EndpointSpec(backend, "receiver", layout, recv_config)])
        for quantized in (False, True) if int8 else (False,):
            method = f"{backend}-int8" if quantized else backend
            sender = make_sender(backend, TransferConfig(timeout_s=TIMEOUT_S, int8=quantized))
            sender.register_pool(pool)
            senders[method], peers[method] = sender, (peer, 0)
    raw_agent = Agent("bench-raw", TransferConfig().ucx_tls)
    raw_agent.register(pool)
    return Side(layout, pool, senders, peers, raw_agent)


def _close(side: Side) -> None:
    for sender in side.senders.values():
        sender.close()
    side.raw_agent.close()
    for peer, _ in {id(p): (p, s) for p, s in side.peers.values()}.values():
        peer.close()


def run_bench(tokens: Sequence[int], dtypes: Sequence[str], repeats: int, int8: bool) -> list[Row]:
    rows: list[Row] = []
    rng = np.random.default_rng(0)
    num_blocks = max(tokens) // BLOCK_SIZE
    for name in dtypes:
        side = _build_side(DTYPES[name], num_blocks, int8)
        try:
            for t in tokens:
                n = t // BLOCK_SIZE
                kv_bytes = n * side.layout.block_bytes
                rows.append(
                    Row(name, t, "nixl-raw-1desc", kv_bytes, _timed(_raw_run(side, n), repeats))
                )
                for method in side.senders:
                    samples = _timed(_kv_run(side, method, n, rng), repeats)
                    rows.append(Row(name, t, method, kv_bytes, samples))
        finally:
            _close(side)
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """Median and best of the repeats; ratios divide by the raw reference's same statistic."""
    ref = {(r.dtype, r.tokens): r for r in rows if r.method == "nixl-raw-1desc"}
    lines = [
        f"{'dtype':<5} {'tokens':>6} {'KV MB':>7} {'method':<15} {'median ms':>10} "
        f"{'GB/s':>6} {'vs raw':>7} {'best GB/s':>10} {'vs raw':>7}"
    ]
    for r in rows:
        base = ref[(r.dtype, r.tokens)]
        lines.append(
            f"{r.dtype:<5} {r.tokens:>6} {r.kv_bytes / 1e6:>7.1f} {r.method:<15} "
            f"{r.median_s * 1e3:>10.1f} {r.gb_per_s:>6.2f} {r.gb_per_s / base.gb_per_s:>7.2f} "
            f"{r.best_gb_per_s:>10.2f} {r.best_gb_per_s / base.best_gb_per_s:>7.2f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--int8", action="store_true", help="also time int8-quantized transfer")
    args = parser.parse_args(argv)
    if any(t % BLOCK_SIZE or t <= 0 for t in args.tokens):
        parser.error(f"--tokens must be positive multiples of the block size {BLOCK_SIZE}")
    rows = run_bench(args.tokens, args.dtypes, args.repeats, args.int8)
    print(format_table(rows))


if __name__ == "__main__":
    main()
