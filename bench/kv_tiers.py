"""KV tiers on a multi-turn chat whose working set is 4x the KV pool: prefix hits and time to
first token with the tiers vs without, in one run, on the same prompts.

    python -m pdserve.bench.kv_tiers [--conversations 8] [--turns 4] [--json out.json]
                                     [--quick]

Each conversation's turn is its whole history plus a new user message (paragraphs of the
real documents in ``bench/data``); the assistant's replies in the history are paragraphs
too, not generated text, so every configuration sees the very same prompts. Turns go
round-robin over the conversations, so a conversation's history has left the pool (4x too
small for all of them) by the time it comes back. Requests run one at a time; each
generates 8 tokens and its TTFT is measured from the call to its first token.

Configurations: ``pool only`` (prefix caching in the pool); ``host exact`` and ``host int8``
(blocks in host memory as their own bytes or as int8, room for the whole working set);
``disk exact`` and ``disk int8`` (no host tier: the blocks go to checksummed files in a
temporary directory). Each engine is built and warmed once. ``tier MB`` is what the tiers
hold at the end.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from pdserve.bench.engine_args import engine_bench_parser, write_rows
from pdserve.bench.kv_peer_fetch import PeerBenchSettings, print_tables, run_peer_bench
from pdserve.bench.kv_tier_loads import TierLoadRow, measure_tier_loads
from pdserve.bench.workload import Tokenize, load_paragraphs
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model.registry import resolve_model
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.engine.worker_state import LoadedModel, load

BLOCK_SIZE = 16
WORKING_SET_OVER_POOL = 4
HOST_BYTES_PER_BLOCK = 740_000  # an fp32 block of the default model (int8: a quarter)
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@dataclass(slots=True, frozen=True)
class Row:
    config: str
    prefix_hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    p90_speedup: float  # pool only's p90 over this configuration's
    wall_s: float
    same_first_tokens: float  # share of requests whose 8 tokens equal pool only's
    tier_mb: float  # bytes the tiers hold at the end


def conversations(tokenize: Tokenize, count: int, turns: int) -> list[list[list[int]]]:
    """Per conversation, per turn: the prompt's token ids (history + new message)."""
    paragraphs = [p for p in load_paragraphs() if 40 <= len(p.split()) <= 90]
    take = iter(paragraphs)
    out = []
    for _ in range(count):
        history = ""
        prompts = []
        for _ in range(turns):
            history += f"<|im_start|>user\n{next(take)}\nWhat does this say?<|im_end|>\n"
            prompts.append(tokenize(history + "<|im_start|>assistant\n"))
            history += f"<|im_start|>assistant\n{next(take)}<|im_end|>\n"
        out.append(prompts)
    return out


def build_engines(loaded: LoadedModel, num_blocks: int, tmp: str) -> dict[str, LLM]:
    pool = {"num_blocks": num_blocks, "block_size": BLOCK_SIZE}
    host_bytes = WORKING_SET_OVER_POOL * num_blocks * HOST_BYTES_PER_BLOCK * 2
    configs: dict[str, dict[str, object]] = {"pool only": {}}
    for codec in ("exact", "int8"):
        configs[f"host {codec}"] = {"host_tier_bytes": host_bytes, "tier_codec": codec}
        configs[f"disk {codec}"] = {"disk_tier_path": f"{tmp}/{codec}", "tier_codec": codec}
    engines = {}
    for name, config in configs.items():
        llm = LLM(None, loaded=loaded, **pool, **config)
        llm.generate("Hello", PARAMS)  # warm: kernels built, pages touched
        engines[name] = llm
    return engines


def run(llm: LLM, order: Sequence[list[int]]) -> tuple[list[float], list[list[int]], float, float]:
    """TTFTs (s), outputs, prefix hit rate of these requests, wall time (tiers start empty)."""
    kv = llm.engine.kv
    hits, queried = kv.prefix_hit_tokens, kv.prefix_queried_tokens
    ttfts, outputs = [], []
    start = time.perf_counter()
    for prompt in order:
        ttft, tokens = _timed(llm, prompt)
        ttfts.append(ttft)
        outputs.append(tokens)
    wall_s = time.perf_counter() - start
    rate = (kv.prefix_hit_tokens - hits) / max(1, kv.prefix_queried_tokens - queried)
    return ttfts, outputs, rate, wall_s


def _timed(llm: LLM, prompt: list[int]) -> tuple[float, list[int]]:
    """One request alone: seconds from the call to its first token, and its tokens."""
    sent = time.perf_counter()
    first: list[float] = []

    def on_step(_step: object) -> None:
        if not first:
            first.append(time.perf_counter())

    result = llm.generate([prompt], PARAMS, on_step=on_step)
    return first[0] - sent, result[0].token_ids


def run_bench(args: argparse.Namespace) -> tuple[list[Row], list[TierLoadRow]]:
    loaded = load(args.model, args.dtype)
    count, turns = (3, 2) if args.quick else (args.conversations, args.turns)
    convs = conversations(lambda t: list(loaded.tokenizer.encode(t)), count, turns)
    order = [convs[c][t] for t in range(turns) for c in range(count)]  # round-robin
    working_set = sum(len(c[-1]) for c in convs)
    longest = max(len(c[-1]) for c in convs) + PARAMS.max_tokens
    # 4x too small for all conversations, never too small for the longest request alone
    num_blocks = max(working_set // WORKING_SET_OVER_POOL, longest) // BLOCK_SIZE + 1
    print(
        f"{len(order)} requests, working set {working_set} tokens, pool {num_blocks} blocks "
        f"x {BLOCK_SIZE} = {num_blocks * BLOCK_SIZE} tokens"
    )
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-tiers-") as tmp:
        engines = build_engines(loaded, num_blocks, tmp)
        results = {}
        for name, llm in tqdm(engines.items(), desc="kv tiers", unit="config"):
            results[name] = run(llm, order)
        pool = engines["pool only"].engine.runner.kv_cache
        loads = measure_tier_loads(tuple(pool.shape[1:]), pool.dtype, Path(tmp) / "loads")
    base_ttfts, base_outputs, _, _ = results["pool only"]
    base_p90 = _p90(base_ttfts)
    rows = []
    for name, (ttfts, outputs, rate, wall_s) in results.items():
        same = sum(a == b for a, b in zip(outputs, base_outputs, strict=True)) / len(outputs)
        tiers = engines[name].engine.tier_stats()
        rows.append(
            Row(
                config=name,
                prefix_hit_rate=rate,
                ttft_p50_ms=statistics.median(ttfts) * 1000,
                ttft_p90_ms=_p90(ttfts) * 1000,
                p90_speedup=base_p90 / _p90(ttfts),
                wall_s=wall_s,
                same_first_tokens=same,
                tier_mb=(tiers.host_used_bytes + tiers.disk_used_bytes) / 1e6,
            )
        )
    return rows, loads


def _p90(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def print_table(rows: Sequence[Row]) -> None:
    print(
        f"{'config':<10} {'prefix hits':>11} {'TTFT p50 ms':>11} {'TTFT p90 ms':>11} "
        f"{'p90 vs pool':>11} {'wall s':>7} {'same tokens':>11} {'tier MB':>8}"
    )
    for r in rows:
        print(
            f"{r.config:<10} {r.prefix_hit_rate:>10.1%} {r.ttft_p50_ms:>11.1f} "
            f"{r.ttft_p90_ms:>11.1f} {r.p90_speedup:>10.2f}x {r.wall_s:>7.1f} "
            f"{r.same_first_tokens:>10.0%} {r.tier_mb:>8.1f}"
        )


def peer_settings(args: argparse.Namespace) -> PeerBenchSettings:
    if args.quick:
        return PeerBenchSettings(
            args.model, args.dtype, repeats=1, prefix_tokens=1024, groups=3, per_group=3,
            shared_prefix_tokens=1024, question_tokens=128, num_blocks=320,
        )  # fmt: skip
    return PeerBenchSettings(args.model, args.dtype, repeats=args.repeats, load=args.load)


def main(argv: Sequence[str] | None = None) -> int:
    parser = engine_bench_parser(
        "kv_tiers", __doc__, "3 conversations x 2; peer fetch: one 1,024-token prefix, 6 requests"
    )
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="peer fetch: prefixes timed")
    parser.add_argument(
        "--load", type=float, default=2.0,
        help="shared-prefix workload: requests per time to compute one document",
    )  # fmt: skip
    parts = parser.add_mutually_exclusive_group()
    parts.add_argument("--tiers-only", action="store_true", help="no peer fetch rows")
    parts.add_argument("--peer-only", action="store_true", help="only the peer fetch rows")
    args = parser.parse_args(argv)
    rows: list[object] = []
    if not args.peer_only:
        tier_rows, load_rows = run_bench(args)
        print_table(tier_rows)
        for load_row in load_rows:
            print(f"{load_row.config:<22} {load_row.load_ms_per_block:.3f} ms per block")
        rows += [*tier_rows, *load_rows]
    if not args.tiers_only:
        tokenizer = load_tokenizer(resolve_model(args.model))
        fetch_row, shared_rows = run_peer_bench(
            peer_settings(args), lambda t: list(tokenizer.encode(t))
        )
        print_tables(fetch_row, shared_rows)
        rows += [fetch_row, *shared_rows]
    write_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
