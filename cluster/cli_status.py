"""`pdserve status`: pools, workers and the locality index of a running cluster, from Redis."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from pdserve.cluster.redis_server import connect, redacted_url
from pdserve.cluster.registry import WorkerRegistry
from pdserve.cluster.settings import Settings
from pdserve.proto.redis_keys import BLOCK_BITS_NS, RedisKeys
from pdserve.proto.workers import WorkerInfo

ROLES = ("prefill", "decode", "colocated")


@dataclass(slots=True, frozen=True)
class WorkerRow:
    worker_id: str
    role: str
    host: str  # the host it runs on: its address without the port
    address: str
    epoch: int
    waiting: int
    running: int
    free_blocks: int | None  # None: not reported
    total_blocks: int
    kv_usage: float
    indexed_blocks: int
    pid: int


@dataclass(slots=True, frozen=True)
class ClusterStatus:
    redis_url: str
    targets: dict[str, int]
    live: dict[str, int]
    workers: tuple[WorkerRow, ...]
    index_blocks: int  # distinct block hashes held by at least one worker
    index_workers: int  # workers with index state


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="show the pools, workers and KV index of a running cluster",
        description="Read the registry and locality index from Redis: per pool the target and "
        "live sizes, per worker role, host, address, epoch, load and KV usage, and the index "
        "size. With several hosts the targets are the head's own pools; live counts every "
        "host's workers.",
    )
    p.add_argument("--redis-url", default=None, help="default: PDSERVE_REDIS_URL, else the "
                   "state file of `pdserve up`")  # fmt: skip
    p.add_argument("--state-file", type=Path, default=Path.home() / ".pdserve" / "up.json")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_status_command)


def connect_from_args(args: argparse.Namespace) -> tuple[redis.Redis, RedisKeys, str]:
    """A client for the cluster's Redis: --redis-url, else PDSERVE_REDIS_URL, else the URL
    (and key prefix) that `pdserve up` wrote to its state file."""
    settings = Settings.from_env()
    url, prefix = args.redis_url or settings.redis_url, settings.key_prefix
    if url is None:
        state_file: Path = args.state_file
        if not state_file.is_file():
            raise ValueError(
                f"no --redis-url given and no state file at {state_file}: is `pdserve up` "
                "running? Pass --redis-url or --state-file"
            )
        state = json.loads(state_file.read_text())
        url, prefix = state["redis_url"], state.get("key_prefix", prefix)
    try:
        return connect(url), RedisKeys(prefix), url
    except redis.ConnectionError as err:
        raise ValueError(f"Redis at {redacted_url(url)} does not answer ({err})") from err


def collect_status(client: redis.Redis, keys: RedisKeys, url: str = "") -> ClusterStatus:
    workers = WorkerRegistry(client, keys).list_workers()
    raw_targets = client.hgetall(keys.pool_target)
    targets = {_text(k): int(v) for k, v in raw_targets.items()}
    live = {role: sum(w.role.value == role for w in workers) for role in ROLES}
    rows = tuple(_row(client, keys, w) for w in workers)
    return ClusterStatus(
        redis_url=redacted_url(url),
        targets=targets,
        live=live,
        workers=rows,
        index_blocks=_count_keys(client, keys.prefix + BLOCK_BITS_NS),
        index_workers=int(client.scard(keys.index_workers)),
    )


def format_status(status: ClusterStatus) -> str:
    lines = [f"Redis {status.redis_url}" if status.redis_url else "Redis"]
    lines.append("pools:")
    for role in ROLES:
        target = status.targets.get(role)
        if target or status.live[role]:
            lines.append(f"  {role:<10} {status.live[role]} live / {target} target")
    lines.append(f"workers: {len(status.workers)}")
    header = ("WORKER", "ROLE", "HOST", "ADDRESS", "EPOCH", "WAIT", "RUN", "FREE", "KV USED",
              "INDEXED")  # fmt: skip
    table = [header]
    for w in status.workers:
        free = "?" if w.free_blocks is None else str(w.free_blocks)
        table.append((
            w.worker_id, w.role, w.host, w.address, str(w.epoch), str(w.waiting), str(w.running),
            f"{free}/{w.total_blocks}", f"{100 * w.kv_usage:.1f}%",
            str(w.indexed_blocks),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines += ["  " + "  ".join(c.ljust(n) for c, n in zip(r, widths, strict=True)) for r in table]
    lines.append(
        f"index: {status.index_blocks} distinct blocks, {status.index_workers} workers indexed"
    )
    return "\n".join(line.rstrip() for line in lines)


def run_status_command(args: argparse.Namespace) -> int:
    client, keys, url = connect_from_args(args)
    try:
        status = collect_status(client, keys, url)
    finally:
        client.close()
    if args.json:
        print(json.dumps(dataclasses.asdict(status), indent=2))
    else:
        print(format_status(status))
    return 0


def _row(client: redis.Redis, keys: RedisKeys, w: WorkerInfo) -> WorkerRow:
    extra = dict(w.load.extra)
    return WorkerRow(
        worker_id=w.worker_id,
        role=w.role.value,
        host=w.address.rsplit(":", 1)[0],
        address=w.address,
        epoch=w.epoch,
        waiting=w.load.waiting,
        running=w.load.running,
        free_blocks=w.load.free_blocks,
        total_blocks=int(extra.get("total_blocks", w.kv_capacity_blocks)),
        kv_usage=float(extra.get("kv_usage", 0.0)),
        indexed_blocks=int(client.scard(keys.worker_blocks(w.worker_id))),
        pid=int(extra.get("pid", 0)),
    )


def _count_keys(client: redis.Redis, prefix: str) -> int:
    pattern = _glob_escape(prefix) + "*"
    return sum(1 for _ in client.scan_iter(match=pattern, count=1000))


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
