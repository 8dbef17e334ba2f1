"""Where time to first token goes: disaggregated (1 prefill + 1 decode worker, NIXL) vs colocated.

Method: three worker processes (``python -m pdserve.worker.server``: a prefill and a decode
worker over NIXL, and one colocated worker; prefix caching off, so every prompt is computed
and sent whole) serve the same prompts, one request at a time, each prompt first
disaggregated then colocated. Prompts are real text (``bench/workload.py``'s corpus), cut to
exact lengths, every one distinct. Greedy, 2 output tokens (EOS ignored): the first from the
prefill, the second from the first decode step. This process drives the workers' gRPC API
the way the router does (disaggregated: ReserveKV, Prefill, and Decode as soon as the first
token is in). One warm-up request per mode is not counted.

A request's TTFT here is the time until the *decode side* has produced a token: request sent
-> the first decode step's token back at this process. Its phases, per request:

- prefill: the worker's engine from taking the request to sampling the first token;
- KV transfer (disaggregated): prefill worker, first token -> its sender saw the last write
  and its completion notice done (block lookup, peer connection, writes, notification);
- 1st decode: the step after the prefill (disaggregated: from when both the Decode call and
  the KV were on the decode worker, admission included);
- queue+rpc: the rest -- gRPC hops, ReserveKV, hand-offs between threads, and any wait in an
  engine queue (none here: one request at a time).

The client-visible TTFT (the first token, which a disaggregated prefill returns before its
transfer) is shown too. Medians over ``--repeats``; ``xfer %`` is the median of the
per-request share of the transfer in the disaggregated TTFT (issue 3's target: < 15% at
2,048 tokens); ``vs coloc`` divides the disaggregated TTFT by the colocated one.

    .venv/bin/python -m pdserve.bench.ttft_breakdown [--tokens 128 512 2048] [--repeats 5]
        [--prefill-core 0 --decode-core 1 --colocated-core 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from pdserve.bench.ttft_workers import WorkerProcess, start_workers
from pdserve.bench.workload import WorkloadSpec, build_workload, default_model_file, load_tokenize
from pdserve.proto import common_pb2, worker_pb2

BLOCK_SIZE = 16
RPC_TIMEOUT_S = 600.0
MODES = ("disaggregated", "colocated")
PHASES = ("queue", "prefill", "transfer", "first_step", "ttft", "client_ttft")  # Sample.*_s


@dataclass(slots=True, frozen=True)
class Sample:
    """One request's phases, in seconds; ``queue_s`` is what the others leave of ``ttft_s``
    (gRPC hops, ReserveKV, hand-offs between threads, waiting in an engine queue)."""

    mode: str
    tokens: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    first_step_s: float
    ttft_s: float  # request sent -> the first decode step's token received
    client_ttft_s: float  # request sent -> the first token received
    kv_bytes: int = 0


def make_sample(
    mode: str, tokens: int, ttft_s: float, client_ttft_s: float, times: dict[str, float]
) -> Sample:
    """A Sample from the client's two times and the workers' ``prefill_s``, ``transfer_s``,
    ``first_step_s`` (and ``kv_bytes``).

    ``queue_s`` is the rest of ``ttft_s``. It can come out slightly negative: the decode
    worker may see the KV land a little before the prefill's sender sees its write complete,
    and then the transfer and the first decode step overlap by that much.
    """
    worker_s = times["prefill_s"] + times["transfer_s"] + times["first_step_s"]
    return Sample(
        mode,
        tokens,
        ttft_s - worker_s,
        times["prefill_s"],
        times["transfer_s"],
        times["first_step_s"],
        ttft_s,
        client_ttft_s,
        int(times.get("kv_bytes", 0)),
    )


@dataclass(slots=True, frozen=True)
class Summary:
    """Medians of one (mode, prompt length) cell, in milliseconds."""

    mode: str
    tokens: int
    repeats: int
    median_ms: dict[str, float]
    transfer_pct: float  # median per-request share of the transfer in ttft_s


def summarize(samples: Sequence[Sample]) -> list[Summary]:
    cells: dict[tuple[str, int], list[Sample]] = {}
    for s in samples:
        cells.setdefault((s.mode, s.tokens), []).append(s)
    out = []
    for (mode, tokens), group in sorted(cells.items(), key=lambda kv: _order(*kv[0])):
        medians = {p: statistics.median(getattr(s, f"{p}_s") for s in group) * 1e3 for p in PHASES}
        share = statistics.median(s.transfer_s / s.ttft_s * 100 for s in group)
        out.append(Summary(mode, tokens, len(group), medians, share))
    return out


def _order(mode: str, tokens: int) -> tuple[int, int]:
    return tokens, MODES.index(mode) if mode in MODES else len(MODES)


def format_table(summaries: Sequence[Summary]) -> str:
    head = ("queue+rpc", "prefill", "KV xfer", "1st dec", "TTFT", "client 1st")
    lines = [
        f"{'tokens':>6} {'mode':<13}" + "".join(f"{h:>11}" for h in head) + "  xfer %  vs coloc",
        f"{'':>6} {'':<13}" + "".join(f"{'(ms)':>11}" for _ in head),
    ]
    colocated = {s.tokens: s for s in summaries if s.mode == "colocated"}
    for s in summaries:
        base = colocated.get(s.tokens)
        ratio = s.median_ms["ttft"] / base.median_ms["ttft"] if base else float("nan")
        cells = "".join(f"{s.median_ms[p]:>11.1f}" for p in PHASES)
        lines.append(f"{s.tokens:>6} {s.mode:<13}{cells}  {s.transfer_pct:>6.1f}  {ratio:>8.2f}")
    return "\n".join(lines)


def _params() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def run_disaggregated(
    prefill: WorkerProcess, decode: WorkerProcess, request_id: str, prompt: Sequence[int]
) -> Sample:
    started_s = time.monotonic()
    reserve = decode.stub.ReserveKV(
        worker_pb2.ReserveKVRequest(request_id=request_id, prompt_token_ids=prompt),
        timeout=RPC_TIMEOUT_S,
    )
    if not reserve.accepted:
        raise RuntimeError(f"{decode.name} refused {request_id} ({len(prompt)} tokens)")
    events = prefill.stub.Prefill(
        worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=_params(),
            destination=reserve.destination,
        ),
        timeout=RPC_TIMEOUT_S,
    )
    first = next(events).first_token
    client_ttft_s = time.monotonic() - started_s
    decode_request = worker_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt, params=_params(), first_token=first
    )
    chunks = decode.stub.Decode(decode_request, timeout=RPC_TIMEOUT_S)
    decoded = next(chunks)
    ttft_s = time.monotonic() - started_s
    report = next(events).transfer
    if not report.ok or not decoded.token_ids:
        raise RuntimeError(f"{request_id}: transfer {report.error!r}, decoded {decoded}")
    for stream in (chunks, events):  # let both streams end cleanly
        list(stream)
    times = {
        "prefill_s": first.phase_times.prefill_s,
        "transfer_s": report.since_first_token_s,
        "first_step_s": decoded.phase_times.first_step_s,
        "kv_bytes": report.bytes,
    }
    return make_sample("disaggregated", len(prompt), ttft_s, client_ttft_s, times)


def run_colocated(worker: WorkerProcess, request_id: str, prompt: Sequence[int]) -> Sample:
    started_s = time.monotonic()
    request = worker_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, params=_params()
    )
    chunks = worker.stub.Generate(request, timeout=RPC_TIMEOUT_S)
    first = next(chunks)
    client_ttft_s = time.monotonic() - started_s
    second = next(chunks)
    ttft_s = time.monotonic() - started_s
    list(chunks)
    times = {
        "prefill_s": first.phase_times.prefill_s,
        "transfer_s": 0.0,
        "first_step_s": second.phase_times.first_step_s,
    }
    return make_sample("colocated", len(prompt), ttft_s, client_ttft_s, times)


def build_prompts(tokens: Sequence[int], repeats: int) -> list[tuple[int, ...]]:
    """``repeats + 1`` distinct prompts per length (the first of all is the warm-up), in
    the order they run: by length, then repeat."""
    count = len(tokens) * repeats + 1
    longest = max(tokens)
    spec = WorkloadSpec(count, longest, longest, min_output_tokens=1, max_output_tokens=1)
    items = build_workload(load_tokenize(default_model_file()), spec)
    lengths = [min(tokens)] + [t for t in tokens for _ in range(repeats)]
    return [prompt[:t] for (prompt, _), t in zip(items, lengths, strict=True)]


def run_bench(
    workers: dict[str, WorkerProcess], prompts: Sequence[tuple[int, ...]], show_progress: bool
) -> list[Sample]:
    """Every prompt disaggregated, then colocated; the first prompt is the warm-up."""
    samples = []
    prefill, decode, colocated = workers["prefill"], workers["decode"], workers["colocated"]
    for i, prompt in enumerate(tqdm(prompts, desc="prompts", disable=not show_progress)):
        samples.append(run_disaggregated(prefill, decode, f"ttft-d{i}", prompt))
        samples.append(run_colocated(colocated, f"ttft-c{i}", prompt))
    return samples[len(MODES) :]


@contextlib.contextmanager
def _work_dir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="ttft-") as tmp:
        yield Path(tmp)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if any(t < 1 for t in args.tokens) or args.repeats < 1:
        raise SystemExit("--tokens must be >= 1 and --repeats >= 1")
    prompts = build_prompts(args.tokens, args.repeats)
    num_blocks = 2 * (max(args.tokens) // BLOCK_SIZE + 2) + 8
    cores = {role: getattr(args, f"{role}_core") for role in ("prefill", "decode", "colocated")}
    with (
        _work_dir(args.work_dir) as work_dir,
        start_workers(work_dir, num_blocks, args.torch_threads, cores) as workers,
    ):
        samples = run_bench(workers, prompts, not args.disable_tqdm)
    summaries = summarize(samples)
    print(format_table(summaries))
    if args.json is not None:
        result = {
            "tokens": args.tokens,
            "repeats": args.repeats,
            "torch_threads": args.torch_threads,
            "cores": cores,
            "summary": [asdict(s) for s in summaries],
            "samples": [asdict(s) for s in samples],
        }
        args.json.write_text(json.dumps(result, indent=2))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--repeats", type=int, default=5, help="requests per length and mode")
    p.add_argument("--torch-threads", type=int, default=1, help="per worker")
    for role in ("prefill", "decode", "colocated"):
        p.add_argument(f"--{role}-core", type=int, default=None, help=f"pin the {role} worker")
    p.add_argument("--work-dir", type=Path, default=None, help="worker logs (default: a tmp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write every sample here")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


if __name__ == "__main__":
    main()
