"""Effect of int8 KV transfer on output: greedy continuations after fp vs int8 transfer.

Method: one process loads the real model once and runs two engines over it with pools of
their own (prefix caching off, so every block is sent and no run reuses another's blocks).
Per prompt, the "prefill" engine computes the prompt and samples the first token (its KV is
held), and that KV moves to the "decode" engine twice, through kv_transfer's in-process
backend: plain (fp -> fp, a byte copy) and int8 (fp -> int8 -> fp: the backend quantizes to
the same wire records the NIXL and TCP senders send, ``quant.encode_records``, and the
receiver dequantizes them with ``quant.decode_records_into``, as theirs do). Each time the
decode engine continues greedily for ``--max-tokens`` tokens (EOS ignored) from the same
first token. Per prompt it reports: tokens identical until the first divergence, tokens
identical position by position, the max |logit difference| over the whole vocabulary at the
first decode step (the one step whose inputs differ only by the KV's quantization), whether
that step's argmax agrees, and the bytes each transfer moved.

Prompts: real text (``bench/workload.py``'s corpus), lengths uniform in the given range.

    .venv/bin/python -m pdserve.bench.int8_effect [--num-prompts 8] [--max-tokens 64]
        [--min-prompt-tokens 128 --max-prompt-tokens 1024] [--dtype float32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pdserve.bench.workload import WorkloadSpec, build_workload
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine, StepRecord
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.worker_state import LoadedModel, load
from pdserve.kv_transfer import TransferConfig, TransferState, make_receiver, make_sender


@dataclass(slots=True, frozen=True)
class Continuation:
    token_ids: tuple[int, ...]  # decoded after the first token
    first_step_logits: torch.Tensor  # [vocab] fp32: the decode engine's first step
    kv_bytes: int  # what the transfer moved (records, not headers)


@dataclass(slots=True, frozen=True)
class PromptResult:
    prompt_tokens: int
    decoded_tokens: int
    agree_prefix_tokens: int  # identical until the first divergence
    agree_tokens: int  # identical position by position
    max_abs_logit_diff: float  # first decode step, whole vocabulary
    first_step_argmax_agrees: bool
    fp_bytes: int
    int8_bytes: int


def compare(prompt_tokens: int, fp: Continuation, int8: Continuation) -> PromptResult:
    """How far the int8 continuation strays from the fp one."""
    assert len(fp.token_ids) == len(int8.token_ids), "both continuations ignore EOS"
    same = [a == b for a, b in zip(fp.token_ids, int8.token_ids, strict=True)]
    prefix = same.index(False) if False in same else len(same)
    diff = (fp.first_step_logits - int8.first_step_logits).abs().max().item()
    argmax_agrees = bool(fp.first_step_logits.argmax() == int8.first_step_logits.argmax())
    return PromptResult(
        prompt_tokens, len(same), prefix, sum(same), diff, argmax_agrees, fp.kv_bytes, int8.kv_bytes
    )


class LogitsTap:
    """Keeps the logits of the first step an engine runs after ``arm()`` that samples (a step
    observer; the engine under test runs one sequence, so that is row 0)."""

    def __init__(self, engine: LLMEngine) -> None:
        engine.add_step_observer(self._observe)
        self._armed = False
        self.logits: torch.Tensor | None = None

    def arm(self) -> None:
        self._armed, self.logits = True, None

    def _observe(self, record: StepRecord) -> None:
        if self._armed and record.logits.shape[0] > 0:  # logits: [num_sampled, vocab]
            self._armed, self.logits = False, record.logits[0].float().clone()


class KVMover:
    """Prefill engine's pool -> decode engine's pool over kv_transfer's in-process backend."""

    def __init__(self, src_pool: torch.Tensor, dst_pool: torch.Tensor) -> None:
        self.receiver = make_receiver("inproc", TransferConfig())
        self.receiver.register_pool(dst_pool)
        self.senders = {q: make_sender("inproc", TransferConfig(int8=q)) for q in (False, True)}
        for sender in self.senders.values():
            sender.register_pool(src_pool)

    def move(self, src_ids: Sequence[int], dst_ids: Sequence[int], int8: bool) -> int:
        """Bytes moved; the in-process backend has finished when ``send`` returns."""
        transfer_id = f"int8-effect-{uuid.uuid4().hex[:12]}"
        expected = self.receiver.expect(transfer_id, dst_ids)
        sent = self.senders[int8].send(
            transfer_id, src_ids, self.receiver.connection_metadata(), dst_ids
        )
        for handle in (sent, expected):
            assert handle.state is TransferState.DONE, f"transfer failed: {handle.error}"
        return sent.bytes_moved

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
        self.receiver.close()


class Int8Effect:
    """Two engines over one loaded model, and the KV mover between their pools."""

    def __init__(self, loaded: LoadedModel, num_blocks: int) -> None:
        cache = CacheConfig(num_blocks=num_blocks, enable_prefix_caching=False)
        config = EngineConfig(dtype=loaded.dtype, cache=cache)  # the weights are ``loaded``
        self.prefill_engine = LLMEngine(config, loaded)
        self.decode_engine = LLMEngine(config, loaded)
        self.mover = KVMover(
            self.prefill_engine.runner.kv_cache, self.decode_engine.runner.kv_cache
        )
        self.decode_tap = LogitsTap(self.decode_engine)

    def run_prompt(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> PromptResult:
        """Prefill once, then continue after an fp and after an int8 transfer of its KV."""
        first = self.prefill(request_id, prompt, max_tokens)
        try:
            fp = self.continue_after_transfer(request_id, prompt, first, max_tokens, int8=False)
            q = self.continue_after_transfer(request_id, prompt, first, max_tokens, int8=True)
        finally:
            self.prefill_engine.release(request_id)
        return compare(len(prompt), fp, q)

    def prefill(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> int:
        """The first token; the prompt's KV stays held in the prefill engine."""
        engine = self.prefill_engine
        engine.add_prefill_request(request_id, list(prompt), _greedy(max_tokens + 1))
        tokens = _run_until_output(engine, request_id)
        assert len(tokens) == 1, f"prefill of {request_id!r} gave {tokens}"
        return tokens[0]

    def continue_after_transfer(
        self, request_id: str, prompt: Sequence[int], first: int, max_tokens: int, int8: bool
    ) -> Continuation:
        """Move the held KV into fresh decode blocks, then decode ``max_tokens`` tokens."""
        seq_id = f"{request_id}-{'int8' if int8 else 'fp'}"
        _, kv_bytes = self.import_kv(request_id, seq_id, prompt, int8)
        return self.decode(seq_id, prompt, first, max_tokens, kv_bytes)

    def import_kv(
        self, request_id: str, seq_id: str, prompt: Sequence[int], int8: bool
    ) -> tuple[tuple[int, ...], int]:
        """Reserve decode blocks for ``seq_id`` and move ``request_id``'s held KV into them;
        returns the decode block ids and the bytes moved."""
        reservation = self.decode_engine.reserve_import(seq_id, list(prompt))
        assert reservation is not None, "the decode pool is too small for the prompt"
        assert reservation.num_local_blocks == 0, "prefix caching is off: nothing is local"
        src_ids = self.prefill_engine.block_table(request_id)
        kv_bytes = self.mover.move(src_ids, reservation.block_ids, int8)
        return reservation.block_ids, kv_bytes

    def decode(
        self, seq_id: str, prompt: Sequence[int], first: int, max_tokens: int, kv_bytes: int = 0
    ) -> Continuation:
        """Greedy ``max_tokens`` tokens after ``first`` from the KV imported for ``seq_id``."""
        engine = self.decode_engine
        assert engine.admit_imported(seq_id, list(prompt), _greedy(max_tokens + 1), first)
        self.decode_tap.arm()
        tokens = _run_until_finished(engine, seq_id)
        assert self.decode_tap.logits is not None, "the engine's step bypassed runner.execute"
        return Continuation(tuple(tokens), self.decode_tap.logits, kv_bytes)

    def close(self) -> None:
        self.mover.close()


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _run_until_output(engine: LLMEngine, request_id: str) -> list[int]:
    """Step until ``request_id`` outputs something; its token ids."""
    while engine.has_unfinished():
        outputs = [o for o in engine.step() if o.request_id == request_id]
        if outputs:
            return [t for o in outputs for t in o.token_ids]
    raise AssertionError(f"{request_id!r} finished without an output")


def _run_until_finished(engine: LLMEngine, request_id: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.token_ids
    return tokens


def summarize(results: Sequence[PromptResult]) -> dict[str, float]:
    decoded = sum(r.decoded_tokens for r in results)
    diffs = [r.max_abs_logit_diff for r in results]
    return {
        "prompts": len(results),
        "prefix_agreement": sum(r.agree_prefix_tokens for r in results) / decoded,
        "overall_agreement": sum(r.agree_tokens for r in results) / decoded,
        "fully_identical_prompts": sum(r.agree_prefix_tokens == r.decoded_tokens for r in results),
        "first_step_argmax_agreement": sum(r.first_step_argmax_agrees for r in results)
        / len(results),
        "max_abs_logit_diff_max": max(diffs),
        "max_abs_logit_diff_median": statistics.median(diffs),
        "bytes_ratio_int8_vs_fp": sum(r.int8_bytes for r in results)
        / sum(r.fp_bytes for r in results),
    }


def format_report(results: Sequence[PromptResult], summary: dict[str, float]) -> str:
    lines = [
        f"{'prompt':>6} {'tokens':>6} {'same until div.':>16} {'same overall':>13} "
        f"{'max|dlogit|':>11} {'argmax':>6} {'fp MB':>7} {'int8 MB':>8}"
    ]
    for i, r in enumerate(results):
        lines.append(
            f"{i:>6} {r.prompt_tokens:>6} {r.agree_prefix_tokens:>8}/{r.decoded_tokens:<7} "
            f"{r.agree_tokens:>6}/{r.decoded_tokens:<6} {r.max_abs_logit_diff:>11.4f} "
            f"{'same' if r.first_step_argmax_agrees else 'DIFF':>6} "
            f"{r.fp_bytes / 1e6:>7.2f} {r.int8_bytes / 1e6:>8.2f}"
        )
    lines.append("")
    lines += [f"{key}: {_fmt(value)}" for key, value in summary.items()]
    return "\n".join(lines)


def _fmt(value: float) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def build_prompts(loaded: LoadedModel, args: argparse.Namespace) -> list[tuple[int, ...]]:
    spec = WorkloadSpec(
        num_requests=args.num_prompts,
        min_prompt_tokens=args.min_prompt_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        min_output_tokens=1,
        max_output_tokens=1,
        seed=args.seed,
    )

    def tokenize(text: str) -> list[int]:
        return loaded.tokenizer.encode(text, add_special_tokens=False)

    return [prompt for prompt, _ in build_workload(tokenize, spec)]


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    loaded = load(args.model, args.dtype)
    prompts = build_prompts(loaded, args)
    block_size = CacheConfig().block_size
    num_blocks = (args.max_prompt_tokens + args.max_tokens + 1) // block_size + 4
    effect = Int8Effect(loaded, num_blocks)
    try:
        bar = tqdm(prompts, desc="prompts", disable=args.disable_tqdm)
        results = [effect.run_prompt(f"p{i}", p, args.max_tokens) for i, p in enumerate(bar)]
    finally:
        effect.close()
    summary = summarize(results)
    print(format_report(results, summary))
    if args.json is not None:
        out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
        out |= {"summary": summary, "prompts": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(out, indent=2))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--min-prompt-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens after the first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write per-prompt results here")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


if __name__ == "__main__":
    main()
