"""A host without the cluster secret tries the cluster's inside, as a program.

    python -m tests.integration.netns_outsider grpc WORKER_ADDRESS...
    python -m tests.integration.netns_outsider kv DESTINATION_HEX
    python -m tests.integration.netns_outsider redis REDIS_URL_WITHOUT_PASSWORD KEY

Run on the test's outsider host (a network namespace of its own, bench/netns_hosts.py),
each prints one JSON line of what happened; the test asserts on it.
``grpc``: GetStats' code and details in plaintext and with another cluster's certificate.
``kv``: ``kv_auth_probe.push_without_the_secret`` against a reserved destination (its own
assertions end the program with an error). ``redis``: the replies to GET and SET without
the password, and the error a redis-py client gets.
"""

from __future__ import annotations

import json
import sys
from urllib.parse import urlsplit

import grpc
import redis

from pdserve.proto import worker_pb2
from pdserve.worker.cluster_secret import ClusterSecret
from tests.integration.auth_probes import redis_replies, stats_error


def main(probe: str, *args: str) -> dict[str, object]:
    if probe == "grpc":
        tries = {"plaintext": None, "other_cluster": ClusterSecret.generate()}
        return {
            address: {name: list(_named(stats_error(address, s))) for name, s in tries.items()}
            for address in args
        }
    if probe == "kv":
        # Here only: it loads torch, seconds that the other probes' processes do without.
        from tests.integration.kv_auth_probe import push_without_the_secret

        (destination,) = args
        push_without_the_secret(worker_pb2.KVDestination.FromString(bytes.fromhex(destination)))
        return {"refused": True}
    assert probe == "redis", f"unknown probe {probe!r}"
    url, key = args
    replies = redis_replies(urlsplit(url), f"GET {key}", f"SET {key} x")
    try:
        redis.Redis.from_url(url, socket_timeout=5).get(key)
        client_error = ""
    except redis.RedisError as err:
        client_error = type(err).__name__
    return {"replies": replies, "client_error": client_error}


def _named(error: tuple[grpc.StatusCode, str]) -> tuple[str, str]:
    return error[0].name, error[1]


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
