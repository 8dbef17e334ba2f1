"""Speculative decoding on this machine: off vs prompt lookup as one chain vs as a token tree,
in one run, on the same requests.

    python -m pdserve.bench.speculative [--rounds 3] [--max-tokens 160] [--json out.json]
                                        [--quick]

Three workloads, every request seeded or greedy, so each configuration produces the very same
tokens (checked) and only the time differs:

* ``copy`` (batch 1): paragraphs of real documents (``bench/data``: licence texts, Python's
  history) to repeat, correct (typos put in) or edit (a word replaced): the answer copies
  long runs of its prompt;
* ``chat`` (batch 1): open questions, sampled (temperature 0.7, seeded): little to copy;
* ``batch32``: 32 requests at once, half of each kind: whether speculation stays out of the
  way when the batch is large.

Each configuration has its own engine, built and warmed once; rounds rotate the order (off,
chain, tree; chain, tree, off; ...) and each figure is the median over rounds, so neither a
slow moment of the machine nor a place in the order favours one of them. Reported per
workload and configuration: output tokens/s and the ratio to off; acceptance length (tokens
per verify step: accepted candidates + 1); for the tree, the candidates it kept off its first
chain (its gain over a single chain); for ``batch32`` also goodput (requests/s meeting TTFT
and TPOT SLOs). ``--quick`` is a smoke run (few, short requests; one round).

First it times one step of a single sequence (800 tokens of context) verifying ``T`` tokens,
as a chain and as a tree, against a one-token decode step: what a candidate costs, which
sets the defaults of ``max_verify_tokens`` and ``min_acceptance``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from pdserve.bench.engine_args import engine_bench_parser, write_rows
from pdserve.bench.workload import load_paragraphs
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.scheduler.plan import BatchPlan, ScheduledChunk
from pdserve.engine.scheduler.token_tree import TokenTree
from pdserve.engine.worker_state import LoadedModel, load

CONFIGS: dict[str, dict[str, object]] = {
    "off": {},
    "ngram-chain": {"speculative": "ngram", "ngram_branches": 1},
    "ngram-tree": {"speculative": "ngram", "ngram_branches": 4},
}
CHAT_QUESTIONS = (
    "What are three good habits for staying healthy?",
    "Explain how a rainbow forms.",
    "Write a short poem about autumn leaves.",
    "Why do cats purr?",
    "Give me some ideas for a weekend trip with friends.",
    "How does a bicycle stay upright?",
    "What should I consider when adopting a dog?",
    "Describe the water cycle in simple words.",
)
TYPOS = {"the": "teh", "and": "adn", "software": "sofware", "license": "licnese", "of": "fo"}
# SLOs of the batch32 workload (this CPU's scale): time to first token, mean time per token.
TTFT_SLO_S = 8.0
TPOT_SLO_S = 0.25
NUM_BLOCKS = 1280  # per engine: 20,480 token slots, room for the 32 requests of batch32


@dataclass(slots=True, frozen=True)
class Request:
    prompt: str
    params: SamplingParams


@dataclass(slots=True)
class Run:
    """One configuration on one workload, one round."""

    wall_s: float
    output_tokens: int
    tokens: list[list[int]]
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    verify_steps: int = 0
    accepted: int = 0
    branch_accepted: int = 0


@dataclass(slots=True, frozen=True)
class Row:
    workload: str
    config: str
    output_tokens_per_s: float
    speedup: float
    verify_steps: int  # over all rounds
    acceptance_length: float
    branch_accepted_share: float  # accepted candidates off the first chain / all accepted
    goodput_rps: float | None


def chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def copy_requests(num: int, max_tokens: int) -> list[Request]:
    """Repeat / correct / edit a paragraph of 60-120 words from the corpus."""
    paragraphs = [p for p in load_paragraphs() if 60 <= len(p.split()) <= 120]
    picked = random.Random(0).sample(paragraphs, num)
    tasks = (
        lambda p: f"Repeat the following text exactly.\n\n{p}",
        lambda p: f"Correct the spelling mistakes in this text:\n\n{_typos(p)}",
        lambda p: f"Rewrite this text with every 'the' in capitals:\n\n{p}",
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [Request(chat(tasks[i % len(tasks)](p)), greedy) for i, p in enumerate(picked)]


def chat_requests(num: int, max_tokens: int) -> list[Request]:
    return [
        Request(chat(q), SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens))
        for i, q in enumerate((CHAT_QUESTIONS * (num // len(CHAT_QUESTIONS) + 1))[:num])
    ]


def _typos(text: str) -> str:
    return " ".join(TYPOS.get(word, word) for word in text.split())


def build_engines(loaded: LoadedModel) -> dict[str, LLM]:
    """One engine per configuration, built once and warmed (kernels built, pages touched):
    engines built between runs ran measurably slower than the first (5% on batch32), which
    would favour whichever configuration came first."""
    engines = {}
    for name, config in CONFIGS.items():
        llm = LLM(None, loaded=loaded, num_blocks=NUM_BLOCKS, **config)
        llm.generate(chat("Hello"), SamplingParams(temperature=0.0, max_tokens=8))
        engines[name] = llm
    return engines


def run_config(llm: LLM, requests: Sequence[Request], batch: bool) -> Run:
    """Batch 1: one request at a time; else all at once. Times every streamed token."""
    before = _spec_counts(llm)
    groups = [list(range(len(requests)))] if batch else [[i] for i in range(len(requests))]
    run = Run(wall_s=0.0, output_tokens=0, tokens=[[] for _ in requests])
    start = time.perf_counter()
    for group in groups:
        _generate_timed(llm, [requests[i] for i in group], group, run)
    run.wall_s = time.perf_counter() - start
    run.output_tokens = sum(len(t) for t in run.tokens)
    after = _spec_counts(llm)
    run.verify_steps, run.accepted, run.branch_accepted = (
        a - b for a, b in zip(after, before, strict=True)
    )
    return run


def _generate_timed(llm: LLM, requests: list[Request], indexes: list[int], run: Run) -> None:
    sent = time.perf_counter()
    first: dict[str, float] = {}
    last: dict[str, float] = {}

    def on_step(step: object) -> None:
        request_id = step.request_id  # type: ignore[attr-defined]
        now = time.perf_counter()
        first.setdefault(request_id, now)
        last[request_id] = now

    results = llm.generate(
        [r.prompt for r in requests], [r.params for r in requests], on_step=on_step
    )
    for index, result in zip(indexes, results, strict=True):
        run.tokens[index] = result.token_ids
        rid, count = result.request_id, len(result.token_ids)
        run.ttft_s.append(first[rid] - sent)
        run.tpot_s.append((last[rid] - first[rid]) / max(1, count - 1))


def _spec_counts(llm: LLM) -> tuple[int, int, int]:
    speculator = llm.engine.speculator
    if speculator is None:
        return 0, 0, 0
    stats = speculator.stats
    return stats.verify_steps, stats.accepted_tokens, stats.branch_accepted_tokens


def summarize(workload: str, name: str, runs: list[Run], off: list[Run], batch: bool) -> Row:
    tps = statistics.median(r.output_tokens / r.wall_s for r in runs)
    off_tps = statistics.median(r.output_tokens / r.wall_s for r in off)
    steps = sum(r.verify_steps for r in runs)
    accepted = sum(r.accepted for r in runs)
    goodput = None
    if batch:
        goodput = statistics.median(
            sum(
                t <= TTFT_SLO_S and p <= TPOT_SLO_S for t, p in zip(r.ttft_s, r.tpot_s, strict=True)
            )
            / r.wall_s
            for r in runs
        )
    return Row(
        workload=workload,
        config=name,
        output_tokens_per_s=tps,
        speedup=tps / off_tps,
        verify_steps=steps,
        acceptance_length=1.0 + accepted / steps if steps else 1.0,
        branch_accepted_share=sum(r.branch_accepted for r in runs) / max(1, accepted),
        goodput_rps=goodput,
    )


def step_costs(loaded: LoadedModel, sizes: Sequence[int], repeats: int) -> list[dict[str, float]]:
    """Median wall time of one forward verifying ``T`` tokens (the pending one and ``T - 1``
    candidates) as a chain and as a tree (two branches), over 800 cached positions."""
    runner = LLM(loaded=loaded, num_blocks=64).engine.runner
    table = tuple(range(64))
    context = 800

    def median_ms(tree: TokenTree | None) -> float:
        tokens = (5, *(tree.tokens if tree else ()))
        plan = BatchPlan((ScheduledChunk("s", tokens, context, table, True, tree),))
        runner.execute(plan)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.execute(plan)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000

    decode_ms = median_ms(None)
    rows = []
    for size in sizes:
        half = (size - 1) // 2
        chain = TokenTree.from_branches([list(range(10, 10 + size - 1))], size)
        tree = TokenTree.from_branches(
            [list(range(10, 10 + size - 1 - half)), list(range(50, 50 + half))], size
        )
        rows.append(
            {"tokens": size, "decode_ms": decode_ms, "chain_ms": median_ms(chain),
             "tree_ms": median_ms(tree)}
        )  # fmt: skip
    return rows


def print_step_costs(rows: Sequence[dict[str, float]]) -> None:
    print(f"{'verified tokens':>15} {'chain ms':>9} {'tree ms':>8}   (decode step 1 token)")
    for row in rows:
        print(
            f"{int(row['tokens']):>15} {row['chain_ms']:>9.1f} {row['tree_ms']:>8.1f}   "
            f"{row['decode_ms']:.1f} ms: chain {row['chain_ms'] / row['decode_ms']:.2f}x, "
            f"tree {row['tree_ms'] / row['decode_ms']:.2f}x"
        )


def run_bench(args: argparse.Namespace) -> list[Row]:
    loaded = load(args.model, args.dtype)
    costs = step_costs(loaded, (3, 5, 9, 17) if not args.quick else (3,), 3 if args.quick else 21)
    print_step_costs(costs)
    n_copy, n_chat, max_tokens = (2, 2, 24) if args.quick else (6, 8, args.max_tokens)
    workloads = {
        "copy": (copy_requests(n_copy, max_tokens), False),
        "chat": (chat_requests(n_chat, max_tokens), False),
        "batch32": (
            (copy_requests(16, max_tokens) + chat_requests(16, max_tokens))
            if not args.quick
            else copy_requests(2, 8) + chat_requests(2, 8),
            True,
        ),
    }
    rounds = 1 if args.quick else args.rounds
    engines = build_engines(loaded)
    names = list(CONFIGS)
    rows: list[Row] = []
    total = len(workloads) * len(CONFIGS) * rounds
    with tqdm(total=total, desc="speculative", unit="run") as bar:
        for workload, (requests, batch) in workloads.items():
            runs: dict[str, list[Run]] = {name: [] for name in CONFIGS}
            for round_index in range(rounds):
                # each configuration takes each place in the order once every len(CONFIGS)
                for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
                    bar.set_postfix_str(f"{workload} {name}")
                    runs[name].append(run_config(engines[name], requests, batch))
                    bar.update(1)
            _check_same_tokens(workload, runs)
            rows += [summarize(workload, n, r, runs["off"], batch) for n, r in runs.items()]
    return rows


def _check_same_tokens(workload: str, runs: dict[str, list[Run]]) -> None:
    reference = runs["off"][0].tokens
    for name, config_runs in runs.items():
        for run in config_runs:
            if run.tokens != reference:
                raise AssertionError(f"{workload}: {name} produced other tokens than off")


def print_table(rows: Sequence[Row]) -> None:
    print(
        f"{'workload':<9} {'config':<12} {'out tok/s':>10} {'vs off':>7} {'verify steps':>12} "
        f"{'accept len':>10} {'off-chain':>9} {'goodput r/s':>11}"
    )
    for row in rows:
        goodput = "" if row.goodput_rps is None else f"{row.goodput_rps:.3f}"
        print(
            f"{row.workload:<9} {row.config:<12} {row.output_tokens_per_s:>10.1f} "
            f"{row.speedup:>6.2f}x {row.verify_steps:>12} {row.acceptance_length:>10.2f} "
            f"{row.branch_accepted_share:>8.1%} {goodput:>11}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = engine_bench_parser("speculative", __doc__, "tiny, one round")
    parser.add_argument("--rounds", type=int, default=3, help="rotating rounds (median)")
    parser.add_argument("--max-tokens", type=int, default=160, help="output cap per request")
    args = parser.parse_args(argv)
    rows = run_bench(args)
    print_table(rows)
    write_rows(rows, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
