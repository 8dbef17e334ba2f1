"""``n > 1``: siblings wait for their leader's prompt KV, then fork from it (copy-on-write)."""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.engine.scheduler.sequence import Sequence


class SiblingGroups:
    """Pending siblings per leader id. A leader's siblings hold no blocks until the fork."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: dict[str, list[Sequence]] = {}

    def add(self, leader: Sequence, siblings: list[Sequence]) -> None:
        if siblings:
            self._pending[leader.seq_id] = list(siblings)

    def num_pending(self) -> int:
        return sum(len(sibs) for sibs in self._pending.values())

    def num_siblings(self, leader_id: str) -> int:
        return len(self._pending.get(leader_id, ()))

    def reserved_slots(self, leader_ids: Iterable[str]) -> int:
        """Sequence slots the given (running) leaders' pending siblings will take."""
        return sum(self.num_siblings(leader_id) for leader_id in leader_ids)

    def pop_ready(self, leader: Sequence) -> list[Sequence]:
        """The leader's siblings once its whole prompt is computed; else nothing."""
        if leader.num_computed_tokens < leader.prompt_len:
            return []
        return self._pending.pop(leader.seq_id, [])

    def pop_group(self, leader_id: str) -> list[Sequence]:
        """All pending siblings of a leader that went away before forking them."""
        return self._pending.pop(leader_id, [])

    def remove_sibling(self, seq_id: str) -> Sequence | None:
        for leader_id, sibs in self._pending.items():
            for sib in sibs:
                if sib.seq_id == seq_id:
                    sibs.remove(sib)
                    if not sibs:
                        del self._pending[leader_id]
                    return sib
        return None
