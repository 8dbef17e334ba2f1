"""When a sequence stops after sampling a token (stop strings are decided by the caller)."""

from __future__ import annotations

from pdserve.engine.scheduler.sequence import Sequence, SequenceStatus


def stop_status(seq: Sequence, max_model_len: int) -> SequenceStatus | None:
    """The finished status ``seq`` reaches with its last output token, or None to go on.

    A stop token wins over length when both apply (it says more about why it ended).
    """
    token = seq.output_token_ids[-1]
    params = seq.params
    if token == seq.eos_token_id and not params.ignore_eos:
        return SequenceStatus.FINISHED_STOPPED
    if token in params.stop_token_ids:
        return SequenceStatus.FINISHED_STOPPED
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH
    return None
