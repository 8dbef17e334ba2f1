"""RecentPlacements: what the router sent where, until the locality index knows (pure)."""

from __future__ import annotations

import pytest

from pdserve.router.state.placements import RecentPlacements

PROMPT = [b"a", b"b", b"c", b"d"]  # chained block hashes of one prompt
OTHER = [b"x", b"y"]


def test_sent_blocks_count_as_held_until_they_expire() -> None:
    placements = RecentPlacements(ttl_s=10.0)
    placements.record("w0", PROMPT[:3], held=0, now_s=100.0)
    assert placements.longest_prefix(PROMPT, ["w0", "w1"], 105.0) == {"w0": 3, "w1": 0}
    assert placements.longest_prefix([b"z", *PROMPT], ["w0"], 105.0) == {"w0": 0}
    assert placements.longest_prefix(PROMPT, ["w0"], 110.0) == {"w0": 0}


def test_sending_again_refreshes_the_expiry() -> None:
    placements = RecentPlacements(ttl_s=10.0)
    placements.record("w0", PROMPT, held=0, now_s=100.0)
    placements.record("w0", PROMPT[:2], held=4, now_s=108.0)
    # the first two blocks were sent again at 108, the last two only at 100
    assert placements.longest_prefix(PROMPT, ["w0"], 112.0) == {"w0": 2}


def test_new_blocks_count_only_what_the_worker_did_not_hold() -> None:
    placements = RecentPlacements(ttl_s=10.0)
    placements.record("w0", PROMPT, held=0, now_s=100.0)
    placements.record("w0", PROMPT, held=4, now_s=101.0)  # a full hit: nothing new
    placements.record("w1", OTHER, held=1, now_s=102.0)
    assert placements.new_blocks(["w0", "w1", "w2"], 103.0) == {"w0": 4, "w1": 1, "w2": 0}
    assert placements.new_blocks(["w0", "w1"], 111.0) == {"w0": 0, "w1": 1}
    assert placements.new_blocks(["w0", "w1"], 112.0) == {"w0": 0, "w1": 0}


def test_at_most_max_blocks_per_worker_are_remembered_oldest_first() -> None:
    placements = RecentPlacements(ttl_s=10.0, max_blocks_per_worker=3)
    placements.record("w0", OTHER, held=0, now_s=100.0)
    placements.record("w0", PROMPT[:2], held=0, now_s=101.0)
    assert placements.longest_prefix(OTHER, ["w0"], 102.0) == {"w0": 0}  # b"x" dropped
    assert placements.longest_prefix(PROMPT, ["w0"], 102.0) == {"w0": 2}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"ttl_s": 0.0}, "ttl_s"), ({"max_blocks_per_worker": 0}, "max_blocks_per_worker")],
)
def test_bad_settings_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RecentPlacements(**kwargs)  # type: ignore[arg-type]
