"""No generation stalls: decode ITL while long prompts arrive, 1P+1D pinned vs 2 colocated.

Method. One invocation starts two clusters one after the other on the same cores (each a
real `pdserve up`: Redis, Ray, workers, router) and runs the same workload against each:

- ``disagg``: 1 prefill worker pinned to core A + 1 decode worker pinned to core B;
- ``colocated``: 2 colocated workers, one pinned to core A, one to core B.

Every worker runs torch with 1 thread. The router and this client are not pinned. The
workload, on the client's clock from t0:

    [0, warmup)            K steady streams start (short prompt, long output, greedy,
                           ignore_eos); each sends its next request as soon as one ends
    [warmup, warmup + D)   measured window: the streams go on, and a fresh LONG prompt
                           (2,048 tokens, no prefix shared) arrives every P seconds
    after                  no new requests; in-flight ones finish and are discarded

Before t0, two long prompts are sent at once and discarded, so the first long prefill of
every worker is not part of the measurement. The ITL of a steady stream is the gap between
two consecutive token events on the client (SSE over the router's OpenAI API); a gap counts
when its later token arrived inside the window. Reported per setup: ITL p50/p90/p99/max,
TTFT of the long prompts, steady-stream tokens/s in the window; and the ratio
p99(disagg) / p99(colocated), which issue 3 wants <= 0.5.

    python -m pdserve.bench.no_stall [--duration-s 60] [--long-every-s 3] [--streams 8]
                             [--cores 0,1] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pdserve.bench.no_stall_report import (
    SETUPS,
    SetupResult,
    Workload,
    format_table,
    report_to_dict,
    setup_up_args,
    summarize_setup,
)
from pdserve.bench.serve.datasets import BenchRequest
from pdserve.bench.serve.openai_client import OpenAIClient
from pdserve.bench.serve.outputs import RequestOptions, RequestOutput
from pdserve.bench.serve.text import TextSource, load_corpus_paragraphs
from pdserve.bench.serve.tokens import load_tokenizer
from pdserve.bench.up_process import process_cores, running_up

WORKER_COMMAND = "ray::WorkerActor"  # how a worker actor process names itself
WARMUP_LONG_PROMPTS = 2  # one per worker of the colocated setup (the router spreads them)
RETRY_PAUSE_S = 0.2  # after a failed stream request: no hot loop against a broken server


class Sender:
    """Sends the workload's requests (fresh prompts from a seeded corpus) and times them."""

    def __init__(self, client: OpenAIClient, source: TextSource, workload: Workload) -> None:
        self.client = client
        self.source = source
        self.workload = workload
        self.streams_done = 0

    async def stream(self, index: int, stop_at_s: float) -> list[RequestOutput]:
        """One steady stream: back-to-back requests until ``stop_at_s`` (perf_counter)."""
        rng = self.workload.rng(f"stream-{index}")
        w, outputs = self.workload, []
        while time.perf_counter() < stop_at_s:
            prompt = self.source.take(rng, w.stream_prompt_tokens)
            out = await self.client.send(BenchRequest(prompt, w.stream_output_tokens))
            outputs.append(out)
            if not out.success:
                await asyncio.sleep(RETRY_PAUSE_S)
        self.streams_done += 1
        return outputs

    async def long(self, index: int, send_at_s: float) -> RequestOutput:
        """One long prompt, sent at ``send_at_s`` (perf_counter)."""
        await asyncio.sleep(max(0.0, send_at_s - time.perf_counter()))
        prompt = self.source.take(self.workload.rng(f"long-{index}"), self.workload.long_tokens)
        return await self.client.send(BenchRequest(prompt, self.workload.long_output_tokens))


async def run_workload(
    base_url: str, source: TextSource, workload: Workload, label: str
) -> tuple[list[RequestOutput], list[RequestOutput], float]:
    """Warm up, then drive the workload; returns (stream outputs, long outputs, t0)."""
    model = await _first_model(base_url)
    connections = workload.streams + len(workload.long_offsets_s()) + WARMUP_LONG_PROMPTS
    options = RequestOptions(model, temperature=0.0, ignore_eos=True)
    client = OpenAIClient(base_url, options, connections)
    sender = Sender(client, source, workload)
    try:
        warm = [sender.long(-1 - i, 0.0) for i in range(WARMUP_LONG_PROMPTS)]
        failed = [o.error for o in await asyncio.gather(*warm) if not o.success]
        if failed:
            raise RuntimeError(f"{label}: warm-up long prompts failed: {failed}")
        t0 = time.perf_counter()
        stop_at_s = t0 + workload.warmup_s + workload.duration_s
        streams = [sender.stream(i, stop_at_s) for i in range(workload.streams)]
        longs = [sender.long(i, t0 + off) for i, off in enumerate(workload.long_offsets_s())]
        gathered = asyncio.gather(asyncio.gather(*streams), asyncio.gather(*longs))
        await _show_progress(gathered, sender, t0, stop_at_s, label)
        stream_outs, long_outs = await gathered
    finally:
        await client.aclose()
    return [o for outs in stream_outs for o in outs], list(long_outs), t0


async def _first_model(base_url: str) -> str:
    client = OpenAIClient(base_url, RequestOptions(model=""), 1)
    try:
        ids = await client.model_ids()
    finally:
        await client.aclose()
    if not ids:
        raise RuntimeError(f"the router at {base_url} lists no models")
    return ids[0]


async def _show_progress(
    work: asyncio.Future[Any], sender: Sender, t0: float, stop_at_s: float, label: str
) -> None:
    """A seconds bar for the run, then one for the in-flight requests' tail."""
    with tqdm(total=round(stop_at_s - t0), desc=f"{label} run", unit="s") as bar:
        while not work.done() and time.perf_counter() < stop_at_s:
            await asyncio.sleep(0.5)
            bar.n = min(bar.total, int(time.perf_counter() - t0))
            bar.refresh()
    with tqdm(total=sender.workload.streams, desc=f"{label} tail", unit="stream") as bar:
        while not work.done():
            await asyncio.sleep(0.5)
            bar.n = sender.streams_done
            bar.refresh()
        bar.n = sender.streams_done
        bar.refresh()


def run_setup(setup: str, args: argparse.Namespace, source: TextSource) -> SetupResult:
    """Start ``setup``'s cluster, run the workload against it, stop it (no orphans)."""
    up_args, env = setup_up_args(setup, args.cores, args.num_blocks, args.policy, args.worker_arg)
    up_args += ["--kv-backend", args.kv_backend, "--dtype", args.dtype]
    work_dir = Path(tempfile.mkdtemp(prefix=f"no_stall_{setup}_"))
    print(f"[{setup}] starting pdserve up {' '.join(up_args)} (log: {work_dir}/up.log)")
    started_s = time.monotonic()
    with running_up(work_dir, up_args, env, args.start_timeout_s) as up:
        print(f"[{setup}] serving at {up.http_url} after {time.monotonic() - started_s:.0f} s")
        cores = process_cores(up.process.pid, WORKER_COMMAND)
        worker_cores = tuple(f"{pid}: {','.join(map(str, c))}" for pid, c in cores.items())
        print(f"[{setup}] worker processes may run on cores: {'; '.join(worker_cores)}")
        outs = asyncio.run(run_workload(up.http_url, source, args.workload, setup))
    if up.orphans_killed:
        print(f"[{setup}] killed processes left behind: {up.orphans_killed}", file=sys.stderr)
    stream_outs, long_outs, t0 = outs
    result = summarize_setup(setup, stream_outs, long_outs, t0, args.workload)
    return replace(result, worker_cores=worker_cores)


def _cores(text: str) -> tuple[int, int]:
    try:
        a, b = (int(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--cores wants two core numbers 'A,B', got {text!r}"
        ) from None
    if a < 0 or b < 0:
        raise argparse.ArgumentTypeError(f"--cores must be >= 0, got {text!r}")
    return a, b


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.no_stall",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add, d = p.add_argument, Workload()
    add("--duration-s", type=float, default=d.duration_s, help="measured window, s")
    add("--warmup-s", type=float, default=d.warmup_s, help="streams only, before it")
    add("--long-every-s", type=float, default=d.long_every_s, help="long prompt period P")
    add("--long-tokens", type=int, default=d.long_tokens)
    add("--long-output-tokens", type=int, default=d.long_output_tokens)
    add("--streams", type=int, default=d.streams, help="steady streams K")
    add("--stream-prompt-tokens", type=int, default=d.stream_prompt_tokens)
    add("--stream-output-tokens", type=int, default=d.stream_output_tokens)
    add("--seed", type=int, default=d.seed)
    add("--cores", type=_cores, default=(0, 1), help="cores A,B (default 0,1)")
    add("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    add("--policy", default=None, help="router routing policy (default: the router's)")
    add("--kv-backend", default="nixl", choices=["nixl", "tcp"])
    add("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
        help="worker dtype (default bfloat16: an fp32 2,048-token prefill takes ~5 s on one "
        "core, longer than the default period)")  # fmt: skip
    add("--num-blocks", type=int, default=640, help="KV blocks per worker")
    add("--worker-arg", action="append", default=[], help="extra worker flag (repeatable)")
    add("--target-ratio", type=float, default=0.5, help="p99 ratio the issue asks for")
    add("--start-timeout-s", type=float, default=600.0)
    add("--json", type=Path, default=None, help="write the results here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.workload = Workload.from_args(args)
    except ValueError as err:
        print(f"no_stall: error: {err}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer("default")  # exact token lengths, prompts sent as ids
    source = TextSource(tokenizer, load_corpus_paragraphs())
    results = [run_setup(setup, args, source) for setup in args.setups]
    print(format_table(results, args.target_ratio))
    if args.json is not None:
        record = report_to_dict(results, args.workload, args.cores, args.target_ratio)
        record["args"] = {k: str(v) for k, v in vars(args).items() if k != "workload"}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
