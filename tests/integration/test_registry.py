"""Worker registry and the embedded redis-server, against a real redis-server."""

from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from pdserve.cluster.redis_server import (
    RedisAuthError,
    RedisServer,
    RedisServerConfig,
    connect,
    embedded_or_external,
    find_redis_server_binary,
    redis_url,
)
from pdserve.cluster.registry import HeartbeatStatus, WorkerRegistry, check_registration
from pdserve.proto.redis_keys import RedisKeys
from pdserve.proto.workers import WorkerInfo, WorkerLoad, WorkerRole


def _info(worker_id: str, role: str, epoch: int) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role=WorkerRole(role),
        address=f"127.0.0.1:{5000 + len(worker_id)}",
        model="SmolLM2-135M-Instruct",
        kv_capacity_blocks=512,
        block_size=16,
        epoch=epoch,
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): it has exited, only its reaping is pending.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_register_heartbeat_list(redis_client: redis.Redis, keys: RedisKeys) -> None:
    reg = WorkerRegistry(redis_client, keys, lease_s=30)
    epochs = {w: reg.allocate_epoch() for w in ("p0", "p1", "d0")}
    assert reg.register(_info("p0", "prefill", epochs["p0"]))
    assert reg.register(_info("p1", "prefill", epochs["p1"]))
    assert reg.register(_info("d0", "decode", epochs["d0"]))

    load = WorkerLoad(waiting=3, running=7, free_blocks=100, extra=(("gpu", 0.5),))
    reply = reg.heartbeat("p1", epochs["p1"], load)
    assert reply.status == HeartbeatStatus.OK and not reply.snapshot_wanted

    assert [w.worker_id for w in reg.list_workers()] == ["d0", "p0", "p1"]
    assert [w.worker_id for w in reg.list_workers(WorkerRole.PREFILL)] == ["p0", "p1"]
    assert [w.worker_id for w in reg.list_workers(WorkerRole.COLOCATED)] == []
    p1 = reg.get("p1")
    assert p1 == dataclasses.replace(_info("p1", "prefill", epochs["p1"]), load=load)

    assert reg.deregister("p0", epochs["p0"])
    assert reg.get("p0") is None
    assert [w.worker_id for w in reg.list_workers()] == ["d0", "p1"]


def test_lease_expiry_makes_worker_vanish(redis_client: redis.Redis, keys: RedisKeys) -> None:
    reg = WorkerRegistry(redis_client, keys, lease_s=1.0)
    e_kept, e_lost = reg.allocate_epoch(), reg.allocate_epoch()
    reg.register(_info("kept", "decode", e_kept))
    reg.register(_info("lost", "decode", e_lost))
    for _ in range(3):  # 'kept' renews every 0.5 s; 'lost' never does
        time.sleep(0.5)
        assert reg.heartbeat("kept", e_kept, WorkerLoad()).status == HeartbeatStatus.OK
    assert [w.worker_id for w in reg.list_workers()] == ["kept"]
    assert reg.get("lost") is None
    assert reg.heartbeat("lost", e_lost, WorkerLoad()).status == HeartbeatStatus.LEASE_LOST
    # The listing pruned the lapsed id from the membership set too.
    assert redis_client.smembers(keys.workers) == {b"kept"}
    # Recovery path: register again under the same epoch.
    assert reg.register(_info("lost", "decode", e_lost))
    assert reg.heartbeat("lost", e_lost, WorkerLoad()).status == HeartbeatStatus.OK


def test_epochs_grow_and_newer_incarnation_wins(redis_client: redis.Redis, keys: RedisKeys) -> None:
    reg = WorkerRegistry(redis_client, keys, lease_s=30)
    epochs = [reg.allocate_epoch() for _ in range(50)]
    assert all(b > a for a, b in itertools.pairwise(epochs))

    old, new = epochs[-2], epochs[-1]
    assert reg.register(_info("w", "prefill", old))
    assert reg.register(_info("w", "prefill", new))  # the restarted process
    assert reg.heartbeat("w", old, WorkerLoad()).status == HeartbeatStatus.SUPERSEDED
    assert not reg.register(_info("w", "prefill", old)), "a stale incarnation must not win back"
    assert not reg.deregister("w", old)
    got = reg.get("w")
    assert got is not None and got.epoch == new
    assert reg.deregister("w", new)


def test_epochs_survive_counter_loss(redis_client: redis.Redis, keys: RedisKeys) -> None:
    reg = WorkerRegistry(redis_client, keys)
    before = reg.allocate_epoch()
    redis_client.delete(keys.epoch_counter)  # what a Redis restart does to the counter
    assert reg.allocate_epoch() > before


@pytest.mark.parametrize(
    "kwargs",
    [
        {"worker_id": ""},
        {"role": "router"},
        {"address": ""},
        {"block_size": 0},
        {"kv_capacity_blocks": -1},
    ],
)
def test_worker_info_rejects_bad_input(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(_info("w", "prefill", 1), **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"worker_id": "a b"}, {"model": ""}, {"kv_capacity_blocks": 0}, {"epoch": 0}],
)
def test_registration_rejects_what_routing_cannot_use(
    redis_client: redis.Redis, keys: RedisKeys, kwargs: dict[str, Any]
) -> None:
    info = dataclasses.replace(_info("w", "prefill", 1), **kwargs)
    with pytest.raises(ValueError):
        check_registration(info)
    with pytest.raises(ValueError):
        WorkerRegistry(redis_client, keys, lease_s=30).register(info)
    assert redis_client.keys(f"{keys.prefix}*") == []


def test_embedded_server_stops_without_orphan() -> None:
    assert find_redis_server_binary().name == "redis-server"
    with RedisServer() as server:
        assert server._proc is not None
        pid = server._proc.pid
        assert connect(server.url).ping()
    assert not server.is_running
    assert not _pid_alive(pid)


def test_external_url_starts_nothing(redis_server: RedisServer) -> None:
    with embedded_or_external(redis_server.url) as url:
        assert url == redis_server.url
    with embedded_or_external(None) as url:
        assert url != redis_server.url and connect(url).ping()


def test_auth_required_and_wrong_password_is_clear() -> None:
    with RedisServer(RedisServerConfig(password="s3cr3t-pw")) as server:
        client = connect(server.url)
        reg = WorkerRegistry(client, RedisKeys("auth:"))
        assert reg.register(_info("w", "colocated", reg.allocate_epoch()))
        for password in ("wrong", None):
            with pytest.raises(RedisAuthError) as err:
                connect(redis_url("127.0.0.1", server.port, password))
            assert "s3cr3t" not in str(err.value) and "password" in str(err.value)


def test_embedded_server_dies_with_a_killed_parent() -> None:
    # The parent is SIGKILLed, so no cleanup code runs: only PR_SET_PDEATHSIG can stop redis.
    code = (
        "from pdserve.cluster.redis_server import RedisServer\n"
        "import sys, time\n"
        "s = RedisServer().start()\n"
        "print(s._proc.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    repo_root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=repo_root
    )
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    assert _pid_alive(child_pid)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while _pid_alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(child_pid), f"redis-server {child_pid} outlived its killed parent"
