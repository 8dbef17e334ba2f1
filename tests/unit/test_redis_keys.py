"""Key names outside the registry and index (those are exercised against a real Redis in
tests/integration): the pool targets and the routers' SLO figures."""

from __future__ import annotations

import pytest

from pdserve.proto.redis_keys import RedisKeys
from pdserve.router.observe.goodput_store import goodput_key, routers_key


def test_pool_target_and_slo_keys_sit_under_the_prefix() -> None:
    keys = RedisKeys("t1:")
    assert keys.pool_target == "t1:pool_target"
    assert keys.slo_router("r-1") == "t1:slo:router:r-1"
    assert keys.slo_routers == "t1:slo:routers"


def test_writers_use_the_key_module_names() -> None:
    keys = RedisKeys("t2:")
    assert goodput_key("t2:", "r-1") == keys.slo_router("r-1")
    assert routers_key("t2:") == keys.slo_routers


def test_a_bad_prefix_is_refused() -> None:
    with pytest.raises(ValueError, match="key prefix must be"):
        RedisKeys("bad prefix")
