"""The receiver's table of expected transfers, with a reaper that enforces deadlines.

Every receiver backend keeps its in-flight transfers here, so they all time out, count and
forget transfers the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.kv_transfer.connector import TransferHandle, TransferState
from pdserve.kv_transfer.stats import TransferCounters


@dataclass(slots=True)
class Expectation:
    handle: TransferHandle
    dst_block_ids: tuple[int, ...]
    deadline_s: float  # time.monotonic() by which the transfer must be DONE
    # Claimed by a local writer (a TCP connection) that enforces the deadline itself, so
    # the reaper never fails a transfer while that writer may still touch its blocks.
    claimed: bool = False


class ExpectationTable:
    """transfer id -> Expectation; thread-safe; one reaper thread per table."""

    def __init__(self, timeout_s: float, counters: TransferCounters) -> None:
        self._timeout_s = timeout_s
        self._counters = counters
        self._cond = threading.Condition()
        self._by_id: dict[str, Expectation] = {}
        self._busy_blocks: set[int] = set()
        # Ended ids stay here for timeout_s: a late message for one must not complete a
        # new transfer that reuses the id, so reuse within that window is refused.
        self._recent: dict[str, float] = {}
        self._closed = False
        self._reaper = threading.Thread(target=self._reap_forever, name="kv-reaper", daemon=True)
        self._reaper.start()

    def add(self, transfer_id: str, dst_block_ids: Sequence[int]) -> TransferHandle:
        """Register an expectation; ValueError on a reused id or blocks already in flight."""
        ids = tuple(dst_block_ids)
        with self._cond:
            if self._closed:
                raise ValueError(f"receiver is closed; cannot expect transfer {transfer_id!r}")
            if transfer_id in self._by_id:
                raise ValueError(f"transfer {transfer_id!r} is already expected")
            if transfer_id in self._recent:
                raise ValueError(
                    f"transfer id {transfer_id!r} ended less than {self._timeout_s}s ago; "
                    "use a fresh id per attempt"
                )
            overlap = sorted(self._busy_blocks.intersection(ids))
            if overlap:
                raise ValueError(
                    f"transfer {transfer_id!r}: destination blocks {overlap[:8]} are already "
                    "targets of another in-flight transfer"
                )
            handle = TransferHandle(transfer_id)
            deadline = time.monotonic() + self._timeout_s
            self._by_id[transfer_id] = Expectation(handle, ids, deadline)
            self._busy_blocks.update(ids)
            self._cond.notify_all()
            return handle

    def __len__(self) -> int:
        with self._cond:
            return len(self._by_id)

    def recently_ended(self, transfer_id: str) -> bool:
        with self._cond:
            return transfer_id in self._recent

    def get(self, transfer_id: str) -> Expectation | None:
        with self._cond:
            return self._by_id.get(transfer_id)

    def wait_for(self, transfer_id: str, timeout_s: float) -> Expectation | None:
        """The expectation for ``transfer_id``, waiting up to ``timeout_s`` for ``expect``;
        None at once when that transfer recently ended (a replay)."""
        with self._cond:
            self._cond.wait_for(
                lambda: transfer_id in self._by_id or transfer_id in self._recent or self._closed,
                timeout=timeout_s,
            )
            return self._by_id.get(transfer_id)

    def start(self, exp: Expectation, *, claim: bool) -> bool:
        """PENDING -> TRANSFERRING; ``claim`` when the caller enforces the deadline itself."""
        with self._cond:
            started = exp.handle.start()
            exp.claimed = started and claim
            return started

    def succeed(self, exp: Expectation, bytes_moved: int, saved_bytes: int) -> bool:
        if not exp.handle.succeed(bytes_moved):
            return False
        self._forget(exp)
        self._counters.record_ok(
            received=bytes_moved, seconds=exp.handle.seconds, saved=saved_bytes
        )
        return True

    def fail(self, exp: Expectation, error: str) -> bool:
        if not exp.handle.fail(error):
            return False
        self._forget(exp)
        self._counters.record_failed(exp.handle.seconds)
        return True

    def close(self) -> None:
        """Fail every open transfer and stop the reaper."""
        with self._cond:
            self._closed = True
            open_exps = list(self._by_id.values())
            self._cond.notify_all()
        for exp in open_exps:
            self.fail(exp, f"receiver closed while transfer {exp.handle.transfer_id!r} was open")
        self._reaper.join(timeout=1.0)

    def _forget(self, exp: Expectation) -> None:
        with self._cond:
            if self._by_id.get(exp.handle.transfer_id) is exp:
                del self._by_id[exp.handle.transfer_id]
                self._busy_blocks.difference_update(exp.dst_block_ids)
                self._recent[exp.handle.transfer_id] = time.monotonic() + self._timeout_s

    def _reap_forever(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                for tid in [t for t, until in self._recent.items() if until <= now]:
                    del self._recent[tid]
                overdue = [e for e in self._by_id.values() if e.deadline_s <= now and not e.claimed]
                waiting = [e.deadline_s for e in self._by_id.values() if not e.claimed]
                if not overdue:
                    next_s = min(waiting, default=now + 0.5)
                    self._cond.wait(timeout=max(0.01, min(next_s - now, 0.5)))
                    continue
            for exp in overdue:
                state = exp.handle.state
                self.fail(exp, _timeout_message(exp, self._timeout_s, state))


def _timeout_message(exp: Expectation, timeout_s: float, state: TransferState) -> str:
    return (
        f"transfer {exp.handle.transfer_id!r} timed out after {timeout_s:.1f}s in state "
        f"{state.name} ({len(exp.dst_block_ids)} blocks expected)"
    )
