"""The step loop: ``plan = scheduler.schedule()`` → ``runner.execute(plan)`` →
``scheduler.update(plan, sampled)``, plus the per-request bookkeeping around it
(detokenization, stop strings, logprobs) that turns sampled ids into streamed outputs."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache import ImportReservation
from pdserve.engine.kv_cache.tiers import TierStats
from pdserve.engine.outputs import StepOutput, TokenLogprob
from pdserve.engine.sampler import Sampler, SampleRequest, SampleResult, is_plain_greedy
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, Sequence, SequenceUpdate
from pdserve.engine.speculative.build import build_speculator
from pdserve.engine.speculative.verify import Verified, greedy_draw, kv_moves, target_draw
from pdserve.engine.stop_strings import StopStringMatcher
from pdserve.engine.tokenizer import IncrementalDetokenizer
from pdserve.engine.worker_state import LoadedModel, build_worker_state

if TYPE_CHECKING:
    from pdserve.engine.scheduler.plan import BatchPlan, ScheduledChunk

# What one sampled chunk produced: its tokens and their sampler results (logprobs).
_Sampled = tuple[tuple[int, ...], tuple[SampleResult, ...]]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _SeqOutputState:
    """Text-side state of one sequence: incremental detokenizer and stop strings."""

    request_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher | None


@dataclass(slots=True, frozen=True)
class StepRecord:
    """One step, as a step observer sees it (after the step, before its outputs return)."""

    plan: BatchPlan
    logits: torch.Tensor  # [num_sampled, vocab]: the rows the sampler read
    step_s: float  # wall time of the whole step: schedule, forward, sample, update


# Called after every non-empty step, on the engine's thread: for measuring tools
# (bench/step_profile.py, bench/int8_effect.py). It must not change the engine.
StepObserver = Callable[[StepRecord], None]


class LLMEngine:
    """A model, its paged KV pool, a scheduler and a sampler, stepped by the caller."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        state = build_worker_state(config, loaded)
        self.model_config = state.model_config
        self.tokenizer = state.tokenizer
        self.kv = state.kv
        self.runner = state.runner
        self.tiers = state.tiers
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.sampler = Sampler()
        self.max_model_len = state.max_model_len
        self.speculator = build_speculator(
            config.speculation,
            LoadedModel(state.source, state.runner.model, state.tokenizer, config.dtype),
            config.cache.block_size,
            config.attention_backend,
            self.max_model_len,
            state.runner.device,
        )
        self._seqs: dict[str, Sequence] = {}
        self._out: dict[str, _SeqOutputState] = {}
        self._request_seqs: dict[str, list[str]] = {}
        # prefill-role requests -> the max_tokens the client asked for
        self._prefill_only: dict[str, int] = {}
        self._step_observers: list[StepObserver] = []

    def add_step_observer(self, observer: StepObserver) -> None:
        """Have ``observer`` see every step from now on (see :class:`StepRecord`)."""
        self._step_observers.append(observer)

    # -- requests ----------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Queue a request. Bad input raises ValueError and leaves the engine unchanged."""
        self._validate(request_id, prompt_token_ids, params)
        seqs = [
            self._new_sequence(request_id, i, prompt_token_ids, params) for i in range(params.n)
        ]
        self._request_seqs[request_id] = [s.seq_id for s in seqs]
        self.kv.prefetch(prompt_token_ids)
        if len(seqs) == 1:
            self.scheduler.add(seqs[0])
        else:
            self.scheduler.add_group(seqs)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV; False if it was not known (or already done)."""
        seq_ids = self._request_seqs.pop(request_id, None)
        if seq_ids is None:
            return False
        for seq_id in seq_ids:
            self.scheduler.abort(seq_id)
            self._forget(seq_id)
        return True

    # -- disaggregation: prefill role ---------------------------------------------------
    def add_prefill_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Prefill role: compute the prompt, sample only the first token, keep the KV.

        The step that samples it reports ``finish_reason`` None when the request goes on
        (on a decode worker) and the real reason when the first token already ends it.
        Either way the blocks stay until :meth:`release`, so they can be sent.
        """
        if params.n != 1:
            raise ValueError(f"disaggregated serving takes n == 1, got n={params.n}")
        self._validate(request_id, prompt_token_ids, params)
        seq = self._new_sequence(request_id, 0, prompt_token_ids, params)
        seq.hold_kv = True
        self._prefill_only[request_id] = params.max_tokens
        seq.params = dataclasses.replace(params, max_tokens=1)
        self._request_seqs[request_id] = [seq.seq_id]
        self.kv.prefetch(prompt_token_ids)
        self.scheduler.add(seq)

    def block_table(self, request_id: str) -> tuple[int, ...]:
        return self.kv.block_table(request_id)

    def release(self, request_id: str) -> bool:
        """Free the KV a prefill kept for transfer."""
        self._prefill_only.pop(request_id, None)
        return self.scheduler.release(request_id)

    # -- disaggregation: decode role -----------------------------------------------------
    def reserve_import(
        self, request_id: str, prompt_token_ids: list[int], record_hits: bool = True
    ) -> ImportReservation | None:
        """Reserve blocks for a prompt whose KV another worker computes (None: no room).
        Leading blocks cached here, in the pool or a tier (loaded now), are not received.
        ``record_hits``: see ``KVCacheManager.reserve_for_import``."""
        if request_id in self._request_seqs or request_id in self.kv:
            raise ValueError(f"request_id {request_id!r} is already known; use a new id")
        reservation = self.kv.reserve_for_import(request_id, prompt_token_ids, record_hits)
        self._sync_tiers()  # save what the reservation evicted before the KV lands there
        return reservation

    def commit_import(self, request_id: str) -> None:
        """The KV received into a reservation has landed: cache its full blocks, so a
        prefill of the same prefix finds them (a peer fetch). The blocks stay reserved until
        :meth:`cancel_import`."""
        self.kv.commit_import(request_id)

    def cancel_import(self, request_id: str) -> None:
        """The transfer failed, the caller went away, or a fetched prefix is in use by its
        prefill: give the reserved blocks back (cached ones stay cached)."""
        if request_id in self.kv and self.scheduler.get(request_id) is None:
            self.kv.free(request_id)

    def admit_imported(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, first_token: int
    ) -> bool:
        """Decode role: the prompt's KV has landed; continue after ``first_token``.

        Returns False when the running set is full (try again after a step).
        """
        self._validate(request_id, prompt_token_ids, params)
        seq = self._new_sequence(request_id, 0, prompt_token_ids, params)
        seq.output_token_ids.append(first_token)
        seq.num_computed_tokens = len(prompt_token_ids)
        admitted = False
        try:
            admitted = self.scheduler.admit_imported(seq)
        finally:
            if not admitted:  # leave nothing behind for a request that is not running
                self._seqs.pop(seq.seq_id, None)
                self._out.pop(seq.seq_id, None)
        if not admitted:
            return False
        self._request_seqs[request_id] = [seq.seq_id]
        self._replay_first_token(seq.seq_id, first_token)
        return True

    def _replay_first_token(self, seq_id: str, first_token: int) -> None:
        """Bring detokenizer and stop-string state to where the prefill worker left them;
        the text it produced was already sent by the prefill worker."""
        out = self._out[seq_id]
        text = out.detokenizer.add(first_token)
        if out.stops is not None:
            out.stops.feed(text)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        start_s = time.perf_counter() if self._step_observers else 0.0
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.decoding(), self.max_model_len)
        plan = self.scheduler.schedule()
        self._sync_tiers()
        if plan.is_empty:
            return []
        logits = self.runner.execute(plan)
        by_seq = self._sample(plan, logits)
        updates = self.scheduler.update(plan, {k: tokens for k, (tokens, _) in by_seq.items()})
        outputs = [out for u in updates if (out := self._emit(u, by_seq[u.seq_id][1]))]
        if self._step_observers:
            record = StepRecord(plan, logits, time.perf_counter() - start_s)
            for observer in self._step_observers:
                observer(record)
        return outputs

    def tier_stats(self) -> TierStats:
        """Counters of the KV tiers under the pool (zeros without tiers)."""
        return self.tiers.stats() if self.tiers is not None else TierStats()

    def _sync_tiers(self) -> None:
        """Before the pool is written: save the blocks it evicted, load the tier hits; then
        say in the KV events where the blocks that moved went."""
        if self.tiers is not None:
            pool = self.runner.kv_cache
            self.tiers.sync(pool, self.kv.take_evictions(), self.kv.take_block_loads())
            self.kv.publish_tier_moves()

    def _sample(self, plan: BatchPlan, logits: torch.Tensor) -> dict[str, _Sampled]:
        """Sample every plain chunk in one call; verify each verify chunk's tree (and move
        its accepted candidates' K/V into place). ``logits``: the runner's rows, plan order."""
        plain: list[ScheduledChunk] = []
        plain_rows: list[int] = []
        verify: list[tuple[ScheduledChunk, int]] = []
        row = 0
        for chunk in plan.chunks:
            if chunk.tree is not None:
                verify.append((chunk, row))
            elif chunk.sample:
                plain.append(chunk)
                plain_rows.append(row)
            row += chunk.num_sampled_rows
        if not verify:  # no speculation this step: every row is a plain chunk's
            results = self.sampler(logits, [self._sample_request(c.seq_id) for c in plain])
            return {c.seq_id: ((r.token_id,), (r,)) for c, r in zip(plain, results, strict=True)}
        sampled: dict[str, _Sampled] = {}
        if plain:
            rows = logits[torch.tensor(plain_rows, dtype=torch.int64, device=logits.device)]
            results = self.sampler(rows, [self._sample_request(c.seq_id) for c in plain])
            sampled = {c.seq_id: ((r.token_id,), (r,)) for c, r in zip(plain, results, strict=True)}
        moves: list[tuple[int, int]] = []
        for chunk, first in verify:
            verified = self._verify(chunk, logits[first : first + chunk.num_sampled_rows])
            sampled[chunk.seq_id] = (verified.token_ids, verified.results)
            moves += kv_moves(verified, chunk.start_pos, chunk.block_table, self.kv.block_size)
        self.runner.move_slots(moves)
        return sampled

    def _verify(self, chunk: ScheduledChunk, logits: torch.Tensor) -> Verified:
        assert self.speculator is not None, "a verify chunk without a speculator"
        request = self._sample_request(chunk.seq_id)
        if is_plain_greedy(request.params):
            draw = greedy_draw(logits.max(dim=-1).indices.tolist())
        else:
            draw = target_draw(self.sampler, logits, request)
        return self.speculator.verify(chunk, draw)

    # -- helpers -----------------------------------------------------------------------
    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self._request_seqs:
            raise ValueError(f"request_id {request_id!r} is already running; use a new id")
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        if params.prior_output_tokens >= len(prompt):
            raise ValueError(
                f"prior_output_tokens ({params.prior_output_tokens}) must be fewer than the "
                f"prompt's {len(prompt)} tokens"
            )
        total = len(prompt) + params.max_tokens
        if len(prompt) >= self.max_model_len or total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the context length {self.max_model_len}; shorten the prompt or "
                "lower max_tokens"
            )
        capacity = self.kv.num_blocks * self.config.cache.block_size
        if total > capacity:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens cannot fit the KV pool "
                f"({capacity} tokens); lower max_tokens or give the worker a larger pool"
            )

    def _new_sequence(
        self, request_id: str, index: int, prompt: list[int], params: SamplingParams
    ) -> Sequence:
        seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
        seq = Sequence(
            seq_id=seq_id,
            prompt_token_ids=list(prompt),
            params=params,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        self._seqs[seq_id] = seq
        stops = (
            StopStringMatcher(params.stop, params.include_stop_str_in_output)
            if params.stop
            else None
        )
        detok = self.tokenizer.incremental_detokenizer(prompt)
        self._out[seq_id] = _SeqOutputState(request_id, index, detok, stops)
        return seq

    def _sample_request(self, seq_id: str) -> SampleRequest:
        seq = self._seqs[seq_id]
        out = self._out[seq_id]
        prompt, output = seq.prompt_token_ids, seq.output_token_ids
        prior = seq.params.prior_output_tokens
        if prior:  # an earlier attempt's output, replayed as prompt: output to the sampler
            prompt, output = prompt[:-prior], [*prompt[-prior:], *output]
        return SampleRequest(seq.params, prompt, output, out.index)

    def _emit(self, update: SequenceUpdate, results: tuple[SampleResult, ...]) -> StepOutput | None:
        out = self._out.get(update.seq_id)
        if out is None:
            return None
        token_ids = update.new_token_ids
        finish = update.finish_reason
        if finish == "length" and self._prefill_only.get(out.request_id, 1) > 1:
            finish = None  # the prefill is done; the decode worker goes on
            self._forget(update.seq_id)
        text = ""
        for count, token_id in enumerate(token_ids, start=1):
            last = count == len(token_ids)
            piece = out.detokenizer.add(token_id)
            if last and finish is not None:
                piece += out.detokenizer.flush()
            if out.stops is not None:
                piece = out.stops.feed(piece)
                if out.stops.stopped and (finish is None or not last):
                    # A stop string ends the output here, even mid-way through a step's tokens.
                    self.scheduler.finish(update.seq_id, "stop")
                    token_ids, finish = token_ids[:count], "stop"
                    text += piece
                    break
                if last and finish is not None:
                    piece += out.stops.flush()
            text += piece
        if finish is not None:
            self._forget(update.seq_id)
        if not token_ids and finish is None:
            return None
        logprobs = tuple(_logprobs(r) for r in results[: len(token_ids)])
        return StepOutput(
            out.request_id, out.index, token_ids, text, tuple(p for p in logprobs if p), finish
        )

    def _forget(self, seq_id: str) -> None:
        out = self._out.pop(seq_id, None)
        self._seqs.pop(seq_id, None)
        if self.speculator is not None:
            self.speculator.forget(seq_id)
        if out is None:
            return
        siblings = self._request_seqs.get(out.request_id, [])
        if all(s not in self._out for s in siblings):
            self._request_seqs.pop(out.request_id, None)


def _logprobs(result: SampleResult) -> TokenLogprob | None:
    if result.logprob is None:
        return None
    return TokenLogprob(result.token_id, result.logprob, result.top_logprobs)
