"""Ending sequences: free (or hold) their KV, and re-home siblings orphaned before a fork."""

from __future__ import annotations

from pdserve.engine.scheduler.sequence import Sequence, SequenceStatus
from pdserve.engine.scheduler.state import SchedulerState


class Finisher:
    """Moves sequences out of the waiting/running sets when they finish or are aborted."""

    __slots__ = ("_state",)

    def __init__(self, state: SchedulerState) -> None:
        self._state = state

    def finish_running(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a running sequence; with ``hold_kv`` (and not aborted) keep its blocks."""
        state = self._state
        del state.running[seq.seq_id]
        self._mark(seq, status)
        self._rehome_siblings(seq)
        if seq.hold_kv and status is not SequenceStatus.FINISHED_ABORTED:
            state.held[seq.seq_id] = seq
        else:
            state.kv.free(seq.seq_id)
            del state.seqs[seq.seq_id]

    def finish(self, seq_id: str, status: SequenceStatus) -> bool:
        """End ``seq_id`` wherever it is; False if unknown or already finished.

        Aborting a finished sequence that holds KV releases that KV.
        """
        state = self._state
        seq = state.seqs.get(seq_id)
        if seq is None:
            return False
        if seq_id in state.held:
            return status is SequenceStatus.FINISHED_ABORTED and self.release(seq_id)
        if seq_id in state.running:
            self.finish_running(seq, status)
            return True
        removed = state.waiting.remove(seq_id) or state.groups.remove_sibling(seq_id)
        assert removed is seq, f"sequence {seq_id!r} is live but neither queued nor running"
        self._mark(seq, status)
        self._rehome_siblings(seq)
        del state.seqs[seq_id]
        return True

    def release(self, seq_id: str) -> bool:
        """Free the KV a finished ``hold_kv`` sequence kept; False if it holds none."""
        seq = self._state.held.pop(seq_id, None)
        if seq is None:
            return False
        self._state.kv.free(seq_id)
        del self._state.seqs[seq_id]
        return True

    @staticmethod
    def _mark(seq: Sequence, status: SequenceStatus) -> None:
        assert status.is_finished, f"{status} is not a finished status"
        seq.status = status
        seq.finish_reason = status.finish_reason

    def _rehome_siblings(self, leader: Sequence) -> None:
        """A leader gone before its prompt KV existed: its first sibling leads the rest."""
        siblings = self._state.groups.pop_group(leader.seq_id)
        if siblings:
            self._state.groups.add(siblings[0], siblings[1:])
            self._state.waiting.push_front(siblings[0])
