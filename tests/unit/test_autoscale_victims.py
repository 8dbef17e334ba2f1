"""Scale-in victims: least unique cached blocks, then least running requests, then id."""

from __future__ import annotations

from pdserve.cluster.autoscale import WorkerObservation, choose_victims
from pdserve.cluster.pool_manager import MemberState


def w(worker_id: str, unique: int, running: int, cached: int = 100) -> WorkerObservation:
    return WorkerObservation(
        worker_id,
        MemberState.READY,
        running_requests=running,
        cached_blocks=cached,
        unique_blocks=unique,
    )


WORKERS = (
    w("decode-3", unique=50, running=0),
    w("decode-1", unique=2, running=9),
    w("decode-0", unique=2, running=1),
    w("decode-2", unique=0, running=20, cached=500),  # everything it caches is held elsewhere
    w("decode-4", unique=2, running=1),
)


def test_least_unique_blocks_first_then_least_running_then_id() -> None:
    assert choose_victims(WORKERS, 1) == ("decode-2",)
    assert choose_victims(WORKERS, 4) == ("decode-2", "decode-0", "decode-4", "decode-1")


def test_counts_outside_the_pool_size() -> None:
    assert choose_victims(WORKERS, 0) == ()
    assert choose_victims(WORKERS, -1) == ()
    assert len(choose_victims(WORKERS, 10)) == 5


def test_order_of_the_input_does_not_matter() -> None:
    assert choose_victims(reversed(WORKERS), 3) == choose_victims(WORKERS, 3)
