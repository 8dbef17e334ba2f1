"""KV transfer across a host link against a raw TCP stream between the same two hosts.

The hosts are network namespaces of this machine on one bridge (``pdserve.bench.netns_hosts``;
needs root), so the link is a veth pair through the kernel, with no shared memory between
the two sides. One prompt's KV (``--tokens`` tokens of the default model in fp32: 30 layers
x K,V x 3 KV heads x 64 dims x 4 bytes = 46,080 bytes a token) moves from a sender process
on one host to a receiver process on the other:

* ``kv``: the TCP backend as the workers run it in a cluster with a secret (the HMAC
  handshake on each connection, the header, the blocks scattered into the receiver's pool,
  the receiver's acknowledgement). Time: ``send`` until the sender's handle is DONE.
* ``raw``: the same number of bytes written by ``socket.sendall`` from one buffer and read
  into one buffer, then a one-byte acknowledgement. Time: connect until the ack.

Each runs once as warm-up, then ``--repeats`` times, alternating; the ratio is kv's rate
over raw's, of the medians and of the best runs.

    sudo .venv/bin/python -m pdserve.bench.multi_host [--tokens 2048] [--repeats 5]

``--routing`` runs the other part instead: link-aware vs link-blind routing to decode hosts
behind a 1 Gbit/s and a 10 Gbit/s link (bench/multi_host_routing.py).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.bench.multi_host_routing import (
    RoutingSettings,
    format_routing_report,
    run_routing_bench,
)
from pdserve.bench.netns_hosts import lan, skip_reason
from pdserve.kv_transfer import (
    KVPoolLayout,
    TransferConfig,
    TransferState,
    make_receiver,
    make_sender,
)
from pdserve.kv_transfer.peer_process import make_pool

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
AUTH_KEY = bytes(range(32))  # both ends share it, as a cluster's hosts share their secret
RAW_PORT = 47_001
TIMEOUT_S = 120.0
DEFAULT_ROUTING = RoutingSettings()
POLL_S = 0.005


def _layout(tokens: int) -> KVPoolLayout:
    blocks = -(-tokens // BLOCK_SIZE)
    return KVPoolLayout(blocks, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32)


def _wait_for(path: Path) -> None:
    deadline_s = time.monotonic() + TIMEOUT_S
    while not path.exists():
        assert time.monotonic() < deadline_s, f"{path.name} never appeared"
        time.sleep(POLL_S)


def _publish(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def receive(directory: Path, host: str, tokens: int, runs: int) -> None:
    """The receiving host: expects each KV run in turn and serves the raw stream."""
    layout = _layout(tokens)
    receiver = make_receiver("tcp", TransferConfig(timeout_s=TIMEOUT_S, host=host,
                                                   auth_key=AUTH_KEY))  # fmt: skip
    receiver.register_pool(make_pool(layout, None))
    raw = threading.Thread(target=_serve_raw, args=(host, layout.num_blocks * layout.block_bytes,
                                                    runs), daemon=True)  # fmt: skip
    raw.start()
    blocks = list(range(layout.num_blocks))
    for run in range(runs):
        handle = receiver.expect(f"run-{run}", blocks)
        if run == 0:
            _publish(directory / "meta", receiver.connection_metadata())
        _publish(directory / f"expecting-{run}", b"")
        assert handle.wait(TIMEOUT_S) is TransferState.DONE, handle.error
    raw.join(TIMEOUT_S)
    receiver.close()


def _serve_raw(host: str, size: int, runs: int) -> None:
    buffer = bytearray(size)
    view = memoryview(buffer)
    with socket.create_server((host, RAW_PORT)) as server:
        for _ in range(runs):
            conn, _ = server.accept()
            with conn:
                got = 0
                while got < size:
                    got += conn.recv_into(view[got:])
                conn.sendall(b"k")


def send(directory: Path, receiver_host: str, tokens: int, runs: int) -> dict[str, list[float]]:
    """The sending host: each run, one KV transfer then one raw stream; seconds of each."""
    layout = _layout(tokens)
    sender = make_sender("tcp", TransferConfig(timeout_s=TIMEOUT_S, auth_key=AUTH_KEY))
    sender.register_pool(make_pool(layout, seed=3))
    payload = bytes(layout.num_blocks * layout.block_bytes)
    blocks = list(range(layout.num_blocks))
    _wait_for(directory / "meta")
    meta = (directory / "meta").read_bytes()
    seconds: dict[str, list[float]] = {"kv": [], "raw": []}
    for run in range(runs):
        _wait_for(directory / f"expecting-{run}")
        start_s = time.perf_counter()
        handle = sender.send(f"run-{run}", blocks, meta, blocks)
        assert handle.wait(TIMEOUT_S) is TransferState.DONE, handle.error
        seconds["kv"].append(time.perf_counter() - start_s)
        start_s = time.perf_counter()
        with socket.create_connection((receiver_host, RAW_PORT), timeout=TIMEOUT_S) as sock:
            sock.sendall(payload)
            assert sock.recv(1) == b"k"
        seconds["raw"].append(time.perf_counter() - start_s)
    sender.close()
    return seconds


@dataclass(slots=True, frozen=True)
class LinkRun:
    tokens: int
    kv_bytes: int
    kv_bytes_per_s: tuple[float, ...]  # per measured run, warm-up left out
    raw_bytes_per_s: tuple[float, ...]


def run_bench(tokens: int, repeats: int) -> LinkRun:
    reason = skip_reason()
    if reason is not None:
        raise SystemExit(f"pdserve.bench.multi_host: {reason}")
    runs = repeats + 1  # the first is the warm-up
    module = (sys.executable, "-m", "pdserve.bench.multi_host")
    with tempfile.TemporaryDirectory() as tmp, lan(("pf", "dc")) as net:
        pf, dc = net.hosts["pf"], net.hosts["dc"]
        directory = Path(tmp)
        shape = (str(tokens), str(runs))
        receiver = dc.popen((*module, "receive", tmp, dc.address, *shape), {},
                            directory / "receiver.log")  # fmt: skip
        sent = pf.run((*module, "send", tmp, dc.address, *shape), {}, timeout_s=600)
        receiver.wait(TIMEOUT_S)
        assert sent.returncode == 0, sent.stdout + sent.stderr
        assert receiver.returncode == 0, (directory / "receiver.log").read_text()
        seconds = json.loads(sent.stdout.splitlines()[-1])
    layout = _layout(tokens)
    kv_bytes = layout.num_blocks * layout.block_bytes
    kv, raw = (tuple(kv_bytes / s for s in seconds[k][1:]) for k in ("kv", "raw"))
    return LinkRun(tokens, kv_bytes, kv, raw)


def format_report(run: LinkRun) -> str:
    lines = [f"{run.tokens} tokens, {run.kv_bytes / 1e6:.1f} MB per run"]
    for stat, pick in (("median", statistics.median), ("best", max)):
        kv, raw = pick(run.kv_bytes_per_s), pick(run.raw_bytes_per_s)
        lines.append(f"{stat:>6}: kv {kv / 1e6:8.1f} MB/s  raw TCP {raw / 1e6:8.1f} MB/s  "
                     f"kv/raw {kv / raw:.0%}")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("receive", "send"):  # one side, inside its host
        role, directory, host, tokens, runs = args
        if role == "receive":
            receive(Path(directory), host, int(tokens), int(runs))
        else:
            print(json.dumps(send(Path(directory), host, int(tokens), int(runs))))
        return
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.multi_host")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    routing = parser.add_argument_group("--routing: link-aware vs link-blind routing "
                                        "(bench/multi_host_routing.py)")  # fmt: skip
    routing.add_argument("--routing", action="store_true",
                         help="run the routing part instead of the transfer one")  # fmt: skip
    routing.add_argument("--requests", type=int, default=DEFAULT_ROUTING.requests,
                         help="measured requests per router")  # fmt: skip
    routing.add_argument("--warmup", type=int, default=DEFAULT_ROUTING.warmup)
    routing.add_argument("--max-tokens", type=int, default=DEFAULT_ROUTING.max_tokens)
    parsed = parser.parse_args(args)
    if parsed.routing:
        settings = RoutingSettings(parsed.tokens, parsed.max_tokens, parsed.requests,
                                   parsed.warmup)  # fmt: skip
        print(format_routing_report(run_routing_bench(settings)))
        return
    print(format_report(run_bench(parsed.tokens, parsed.repeats)))


if __name__ == "__main__":
    main()
