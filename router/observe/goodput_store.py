"""Publishes the router's SLO/goodput figures to Redis for the autoscaler and dashboards.

Keys (``<P>`` = the cluster's key prefix, default ``pdserve:``; names from
``pdserve.proto.redis_keys.RedisKeys``, the one key schema; see docs/redis-schema.md):

- ``<P>slo:router:<router_id>`` HASH, rewritten whole every ``publish_interval_s`` and
  expiring after three intervals, so a router that stopped disappears on its own::

      router_id  slo_ttft_ms  slo_tpot_ms  updated_unix_ms  windows ("10s,60s")
      requests:<w>  good_requests:<w>  request_rps:<w>  goodput_rps:<w>  slo_attainment:<w>
      prompt_tps:<w>  output_tps:<w>   (prompt and output tokens per second)
      span_s:<w>   (seconds the rates divide by: less than the window while the router is
                    younger than it)
      ttft_mean_s:<w>  tpot_mean_s:<w>   (over the requests served; absent without any)

  ``<w>`` is a window label such as ``10s``; ``slo_attainment:<w>`` is absent when no
  request finished in that window.
- ``<P>slo:routers`` SET of router ids that published; readers drop ids whose hash expired.

Redis being down never stops the router: the first failure is logged, later ones are not,
and recovery is logged once. ``redis`` is imported only when a store is built.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.proto.redis_keys import RedisKeys, check_worker_id
from pdserve.router.observe.goodput import GoodputFigures, SloConfig, window_label

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)


def goodput_key(prefix: str, router_id: str) -> str:
    """``<P>slo:router:<router_id>``: one router's latest figures (HASH)."""
    return RedisKeys(prefix).slo_router(check_worker_id(router_id))


def routers_key(prefix: str) -> str:
    """``<P>slo:routers``: ids of routers that published (SET)."""
    return RedisKeys(prefix).slo_routers


def default_router_id() -> str:
    """``router-<host>-<pid>`` with characters a key component allows."""
    raw = f"router-{socket.gethostname()}-{os.getpid()}"
    return re.sub(r"[^A-Za-z0-9._\-]", "-", raw)[:128]


def goodput_fields(
    router_id: str, slo: SloConfig, figures: Sequence[GoodputFigures], now_unix_s: float
) -> dict[str, str]:
    """The HASH written for one publication (pure)."""
    fields = {
        "router_id": router_id,
        "slo_ttft_ms": repr(slo.ttft_ms),
        "slo_tpot_ms": repr(slo.tpot_ms),
        "updated_unix_ms": str(int(now_unix_s * 1000)),
        "windows": ",".join(window_label(f.window_s) for f in figures),
    }
    for f in figures:
        w = window_label(f.window_s)
        fields[f"requests:{w}"] = str(f.requests)
        fields[f"good_requests:{w}"] = str(f.good_requests)
        fields[f"request_rps:{w}"] = repr(f.request_rps)
        fields[f"goodput_rps:{w}"] = repr(f.goodput_rps)
        fields[f"prompt_tps:{w}"] = repr(f.prompt_tokens_per_s)
        fields[f"output_tps:{w}"] = repr(f.output_tokens_per_s)
        fields[f"span_s:{w}"] = repr(f.span_s)
        for field_name, value in (("ttft_mean_s", f.ttft_mean_s), ("tpot_mean_s", f.tpot_mean_s)):
            if value is not None:
                fields[f"{field_name}:{w}"] = repr(value)
        if f.slo_attainment is not None:
            fields[f"slo_attainment:{w}"] = repr(f.slo_attainment)
    return fields


class GoodputStore:
    """Writes one router's figures under :func:`goodput_key` (blocking calls; see ``run``)."""

    def __init__(self, client: redis.Redis, slo: SloConfig, router_id: str = "") -> None:
        import redis as redis_mod  # lazy: importing router/ never pulls in redis

        self.client = client
        self.slo = slo
        self.router_id = check_worker_id(router_id or slo.router_id or default_router_id())
        self.key = goodput_key(slo.redis_prefix, self.router_id)
        self.routers_key = routers_key(slo.redis_prefix)
        self.ttl_ms = int(3 * slo.publish_interval_s * 1000)
        self._down_errors: tuple[type[BaseException], ...] = (
            redis_mod.ConnectionError,
            redis_mod.TimeoutError,
            OSError,
        )
        self._outage: str | None = None

    @classmethod
    def from_url(cls, slo: SloConfig, timeout_s: float = 1.0) -> GoodputStore:
        """A store for ``slo.redis_url``; connects lazily, so Redis may be down now."""
        import redis as redis_mod

        if not slo.redis_url:
            raise ValueError("SloConfig.redis_url is not set: there is no Redis to publish to")
        client = redis_mod.Redis.from_url(
            slo.redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        return cls(client, slo)

    def publish(self, figures: Sequence[GoodputFigures]) -> bool:
        """Replace the hash in one transaction; False (logged once) while Redis is down."""
        fields = goodput_fields(self.router_id, self.slo, figures, time.time())
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(self.key)
            pipe.hset(self.key, mapping=fields)  # type: ignore[arg-type]
            pipe.pexpire(self.key, self.ttl_ms)
            pipe.sadd(self.routers_key, self.router_id)
            pipe.execute()
        except self._down_errors as err:
            if self._outage is None:
                self._outage = repr(err)
                log.warning("cannot publish goodput to Redis (will keep trying): %r", err)
            return False
        if self._outage is not None:
            log.warning("publishing goodput to Redis again (outage began with %s)", self._outage)
            self._outage = None
        return True

    async def run(self, figures_fn: Callable[[], Sequence[GoodputFigures]]) -> None:
        """Publish ``figures_fn()`` every ``publish_interval_s``, forever (run as a task)."""
        while True:
            await asyncio.to_thread(self.publish, figures_fn())
            await asyncio.sleep(self.slo.publish_interval_s)

    def close(self) -> None:
        self.client.close()


@dataclass(slots=True, frozen=True)
class StoredWindow:
    window: str  # e.g. "10s"
    requests: int
    good_requests: int
    request_rps: float
    goodput_rps: float
    slo_attainment: float | None
    prompt_tokens_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    span_s: float = 0.0  # what the rates divide by (< the window while the router is young)
    ttft_mean_s: float | None = None
    tpot_mean_s: float | None = None


@dataclass(slots=True, frozen=True)
class StoredGoodput:
    """One router's published figures, as a reader (autoscaler, dashboard) sees them."""

    router_id: str
    updated_unix_ms: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    windows: tuple[StoredWindow, ...]


def read_goodput(client: redis.Redis, prefix: str = "pdserve:") -> list[StoredGoodput]:
    """Every live router's figures, sorted by id; prunes ids whose hash expired."""
    ids = sorted(_text(m) for m in client.smembers(routers_key(prefix)))
    pipe = client.pipeline(transaction=False)
    for router_id in ids:
        pipe.hgetall(goodput_key(prefix, router_id))
    out: list[StoredGoodput] = []
    for router_id, raw in zip(ids, pipe.execute(), strict=True):
        if not raw:
            client.srem(routers_key(prefix), router_id)
            continue
        out.append(parse_goodput({_text(k): _text(v) for k, v in raw.items()}))
    return out


def parse_goodput(fields: dict[str, str]) -> StoredGoodput:
    """The inverse of :func:`goodput_fields` (pure)."""
    windows = tuple(
        StoredWindow(
            window=w,
            requests=int(fields[f"requests:{w}"]),
            good_requests=int(fields[f"good_requests:{w}"]),
            request_rps=float(fields[f"request_rps:{w}"]),
            goodput_rps=float(fields[f"goodput_rps:{w}"]),
            slo_attainment=_float_or_none(fields.get(f"slo_attainment:{w}")),
            prompt_tokens_per_s=float(fields.get(f"prompt_tps:{w}", 0.0)),
            output_tokens_per_s=float(fields.get(f"output_tps:{w}", 0.0)),
            span_s=float(fields.get(f"span_s:{w}", 0.0)),
            ttft_mean_s=_float_or_none(fields.get(f"ttft_mean_s:{w}")),
            tpot_mean_s=_float_or_none(fields.get(f"tpot_mean_s:{w}")),
        )
        for w in fields["windows"].split(",")
        if w
    )
    return StoredGoodput(
        router_id=fields["router_id"],
        updated_unix_ms=int(fields["updated_unix_ms"]),
        slo_ttft_ms=float(fields["slo_ttft_ms"]),
        slo_tpot_ms=float(fields["slo_tpot_ms"]),
        windows=windows,
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _float_or_none(value: str | None) -> float | None:
    return None if value is None else float(value)
