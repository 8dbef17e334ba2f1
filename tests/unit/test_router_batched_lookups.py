"""router/state/batched_lookups.py over a FAKE batch index (a list of canned answers), so that
when each batch leaves and what it holds can be controlled exactly."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

import pytest

from pdserve.router.state.batched_lookups import BatchedLookups, Query
from tests.loop_ticks import LoopTicks


class FakeBatchIndex:
    """FAKE index: answers {worker: first block hash} per query; the first batch can be held
    back until ``release`` is set, and ``fail`` makes a batch raise."""

    def __init__(self, hold_first: bool = False) -> None:
        self.batches: list[list[Query]] = []
        self.release = threading.Event()
        self.hold_first = hold_first
        self.fail = False

    def longest_prefix_many(self, queries: Sequence[Query]) -> list[dict[str, int]]:
        self.batches.append(list(queries))
        if self.hold_first and len(self.batches) == 1:
            assert self.release.wait(5), "the test never released the first batch"
        if self.fail:
            raise ConnectionError("index down")
        return [{w: int(hashes[0]) for w in workers} for hashes, workers in queries]


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.001)


def test_lookups_made_while_a_batch_is_out_leave_together() -> None:
    async def scenario() -> None:
        index = FakeBatchIndex(hold_first=True)
        lookups = BatchedLookups(index, timeout_s=5)
        first = asyncio.create_task(lookups.longest_prefix([1], ["w0"]))
        await _until(lambda: len(index.batches) == 1)
        later = [asyncio.create_task(lookups.longest_prefix([n], ["w0", "w1"])) for n in (2, 3)]
        await asyncio.sleep(0.01)
        index.release.set()
        assert await first == {"w0": 1}
        assert [await t for t in later] == [{"w0": 2, "w1": 2}, {"w0": 3, "w1": 3}]
        assert [len(b) for b in index.batches] == [1, 2], "the two waited and left as one batch"

    asyncio.run(scenario())


def test_a_stuck_index_times_out_without_blocking_the_loop() -> None:
    async def scenario() -> None:
        index = FakeBatchIndex(hold_first=True)
        lookups = BatchedLookups(index, timeout_s=0.05)
        async with LoopTicks() as ticks:
            assert await lookups.longest_prefix([1], ["w0"]) == {}, "no answer in time: load only"
            assert await lookups.longest_prefix([2], ["w0"]) == {}, "queued behind it: same"
        assert ticks.count > 10, "the event loop kept running while the index was stuck"
        lookups.timeout_s = 5
        third = asyncio.create_task(lookups.longest_prefix([3], ["w0"]))
        await asyncio.sleep(0.01)
        index.release.set()
        assert await third == {"w0": 3}
        assert index.batches[1] == [([3], ["w0"])], "the timed-out lookup was not sent"

    asyncio.run(scenario())


def test_a_cancelled_request_s_lookup_is_not_sent() -> None:
    async def scenario() -> None:
        index = FakeBatchIndex(hold_first=True)
        lookups = BatchedLookups(index, timeout_s=5)
        first = asyncio.create_task(lookups.longest_prefix([1], ["w0"]))
        await _until(lambda: len(index.batches) == 1)
        gone = asyncio.create_task(lookups.longest_prefix([2], ["w0"]))  # its client leaves
        kept = asyncio.create_task(lookups.longest_prefix([3], ["w0"]))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        index.release.set()
        assert (await first, await kept) == ({"w0": 1}, {"w0": 3})
        assert index.batches[1] == [([3], ["w0"])]

    asyncio.run(scenario())


def test_a_failing_batch_answers_empty_and_the_next_one_works() -> None:
    async def scenario() -> None:
        index = FakeBatchIndex()
        lookups = BatchedLookups(index)
        index.fail = True
        assert await lookups.longest_prefix([5], ["w0"]) == {}
        index.fail = False
        assert await lookups.longest_prefix([6], ["w0"]) == {"w0": 6}

    asyncio.run(scenario())


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        BatchedLookups(FakeBatchIndex(), timeout_s=0)
