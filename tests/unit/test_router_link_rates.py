"""The measured link rate table: which transfers count, the weighted mean, ageing."""

from __future__ import annotations

import pytest

from pdserve.router.state.link_rates import LinkRates

MIB = 1024 * 1024


def test_a_first_transfer_sets_the_rate_and_small_ones_do_not_count() -> None:
    links = LinkRates(min_bytes=MIB)
    links.observe("p0", "d0", 4 * MIB, 2.0, now_s=0.0)
    links.observe("p0", "d1", MIB - 1, 0.001, now_s=0.0)  # too small to say anything
    links.observe("p0", "d1", 4 * MIB, 0.0, now_s=0.0)  # no duration: no rate
    assert links.rates(now_s=0.0) == {("p0", "d0"): 2 * MIB}


def test_later_transfers_move_the_rate_by_the_weight() -> None:
    links = LinkRates(weight=0.25, min_bytes=1)
    links.observe("p0", "d0", 1000, 1.0, now_s=0.0)
    links.observe("p0", "d0", 5000, 1.0, now_s=1.0)  # 1000 + 0.25 x (5000 - 1000)
    assert links.rates(now_s=1.0)[("p0", "d0")] == pytest.approx(2000.0)
    links.observe("p0", "d0", 2000, 1.0, now_s=2.0)
    assert links.rates(now_s=2.0)[("p0", "d0")] == pytest.approx(2000.0)


def test_directions_are_separate_links() -> None:
    links = LinkRates(min_bytes=1)
    links.observe("p0", "d0", 100, 1.0, now_s=0.0)
    assert ("d0", "p0") not in links.rates(now_s=0.0)


def test_a_pair_not_measured_for_max_age_is_forgotten_and_starts_afresh() -> None:
    links = LinkRates(weight=0.5, min_bytes=1, max_age_s=60.0)
    links.observe("p0", "d0", 100, 1.0, now_s=0.0)
    links.observe("p0", "d1", 100, 1.0, now_s=30.0)
    assert set(links.rates(now_s=60.0)) == {("p0", "d0"), ("p0", "d1")}
    assert set(links.rates(now_s=61.0)) == {("p0", "d1")}
    # A new report after the age limit replaces the old mean rather than blending with it.
    links.observe("p0", "d1", 900, 1.0, now_s=95.0)
    assert links.rates(now_s=95.0)[("p0", "d1")] == pytest.approx(900.0)


def test_expiry_is_exact_after_the_oldest_pair_is_measured_again() -> None:
    """Reads look for stale pairs only once the oldest measurement may have aged out; a
    pair measured again since then must neither be dropped nor hide a younger one's age."""
    links = LinkRates(min_bytes=1, max_age_s=60.0)
    links.observe("p0", "d0", 100, 1.0, now_s=0.0)
    links.observe("p0", "d1", 100, 1.0, now_s=10.0)
    links.observe("p0", "d0", 100, 1.0, now_s=50.0)  # d1 is the oldest now
    assert set(links.rates(now_s=61.0)) == {("p0", "d0"), ("p0", "d1")}
    assert set(links.rates(now_s=70.0)) == {("p0", "d0"), ("p0", "d1")}
    assert set(links.rates(now_s=70.5)) == {("p0", "d0")}
    assert set(links.rates(now_s=110.0)) == {("p0", "d0")}
    assert links.rates(now_s=110.5) == {}


def test_reads_share_one_read_only_table_until_it_changes() -> None:
    links = LinkRates(min_bytes=1, max_age_s=60.0)
    links.observe("p0", "d0", 100, 1.0, now_s=0.0)
    first = links.rates(now_s=1.0)
    assert links.rates(now_s=2.0) is first
    with pytest.raises(TypeError):
        first[("p0", "d1")] = 1.0  # type: ignore[index]
    links.observe("p0", "d1", 300, 1.0, now_s=3.0)
    assert links.rates(now_s=3.0) == {("p0", "d0"): 100.0, ("p0", "d1"): 300.0}
    assert first == {("p0", "d0"): 100.0}  # what a routed request saw stays as it was
    assert links.rates(now_s=61.0) == {("p0", "d1"): 300.0}


@pytest.mark.parametrize(
    "kwargs", [{"weight": 0.0}, {"weight": 1.5}, {"min_bytes": 0}, {"max_age_s": 0.0}]
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LinkRates(**kwargs)  # type: ignore[arg-type]
