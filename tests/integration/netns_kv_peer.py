"""One end of a KV transfer between two test hosts (network namespaces), as a program.

    python -m tests.integration.netns_kv_peer receiver|sender BACKEND DIR HOST_ADDRESS

Both ends hold one key (the TCP path authenticates each connection with it, as workers do
with the key of their cluster secret). The receiver registers a zeroed pool, writes its
connection metadata to DIR/meta and expects ``DST``; the sender registers a seeded pool and
writes ``SRC`` into those blocks. Each prints one JSON line: the transfer's end state, its
counted bytes, and (receiver) whether the blocks that landed are the sender's, bit for bit,
with every other block still zero.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.factory import make_receiver, make_sender
from pdserve.kv_transfer.layout import KVPoolLayout
from pdserve.kv_transfer.peer_process import make_pool

LAYOUT = KVPoolLayout(16, 4, 16, 2, 64, torch.float32)  # 64 KiB blocks
SRC, DST = [0, 1, 2, 4], [3, 5, 6, 7]
SEED = 7
AUTH_KEY = bytes(range(32))  # both ends share it, as a cluster's hosts share their secret
TIMEOUT_S = 60.0


def main(role: str, backend: str, directory: Path, host: str) -> dict[str, object]:
    config = TransferConfig(timeout_s=TIMEOUT_S, host=host, auth_key=AUTH_KEY)
    meta = directory / f"{backend}.meta"
    if role == "receiver":
        pool = make_pool(LAYOUT, None)
        receiver = make_receiver(backend, config)
        receiver.register_pool(pool)
        handle = receiver.expect("t-1", DST)
        tmp = meta.with_suffix(".tmp")
        tmp.write_bytes(receiver.connection_metadata())
        tmp.replace(meta)
        state = handle.wait(TIMEOUT_S)
        sent = make_pool(LAYOUT, SEED)
        others = [b for b in range(LAYOUT.num_blocks) if b not in DST]
        exact = torch.equal(pool[DST], sent[SRC]) and not pool[others].any()
        result = {"state": state.name, "bytes": receiver.stats().bytes_received, "exact": exact}
        receiver.close()
        return result
    deadline_s = time.monotonic() + TIMEOUT_S
    while not meta.exists():
        assert time.monotonic() < deadline_s, "the receiver never wrote its metadata"
        time.sleep(0.1)
    sender = make_sender(backend, config)
    sender.register_pool(make_pool(LAYOUT, SEED))
    state = sender.send("t-1", SRC, meta.read_bytes(), DST).wait(TIMEOUT_S)
    result = {"state": state.name, "bytes": sender.stats().bytes_sent}
    sender.close()
    return result


if __name__ == "__main__":
    role, backend, directory, host = sys.argv[1:5]
    print(json.dumps(main(role, backend, Path(directory), host)), flush=True)
