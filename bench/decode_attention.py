"""Decode attention on the paged pool: our kernel against the best pure-torch path, side by side.

    python -m pdserve.bench.decode_attention [--dtype fp32|bf16] [--seqs 8,16,32,48,64]
        [--context 300,700] [--repeats 5]

One decode step of B sequences (context lengths spread over 0.5-1.5x the given one), all 30
layers of SmolLM2's attention (9 query and 3 kv heads of 64), the K/V in a pool laid out as
the engine's (huge pages, block size 16) under shuffled block ids, so each block is a
separate 12 KB run per layer as in a pool that has served for a while. Both paths run
through ``CpuAttentionBackend`` as a runner calls it, storing the step's K/V too: ``grouped``
(gather into a reused buffer, one SDPA call per length-sorted group) and ``native``
(``paged_decode.c``, in place). Milliseconds per step (best of three rounds), the rate at
which each reads the cached K/V, and the ratio; the machine's copy bandwidth, measured in the
same run, says how close that rate is to memory speed.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence

import torch

from pdserve.bench.baselines_hf import TORCH_DTYPES
from pdserve.bench.floor import measure_memory_bandwidth_gb_s
from pdserve.bench.fused_ops import time_per_call_us
from pdserve.engine.attention.base import AttentionMetadata, StepLayout
from pdserve.engine.attention.cpu import CpuAttentionBackend
from pdserve.engine.host_memory import advise_huge_pages

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def make_step(
    num_seqs: int, context: int, dtype: torch.dtype, seed: int = 0
) -> tuple[StepLayout, torch.Tensor]:
    """A decode step's layout (one new token per sequence) over a fresh pool, shuffled ids."""
    rng = random.Random(seed)
    lens = [rng.randint(max(1, context // 2), context * 3 // 2) for _ in range(num_seqs)]
    widths = [-(-n // BLOCK) for n in lens]
    ids = list(range(sum(widths)))
    rng.shuffle(ids)
    tables, start = [], 0
    for width in widths:
        tables.append(tuple(ids[start : start + width]))
        start += width
    pool = torch.empty(len(ids), LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    advise_huge_pages(pool)  # as the runner's pool: before the first write
    pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(seed)))
    layout = StepLayout(
        query_start_loc=tuple(range(num_seqs + 1)),
        start_positions=tuple(n - 1 for n in lens),
        context_lens=tuple(lens),
        block_tables=tuple(tables),
    )
    return layout, pool


def run_step(
    backend: CpuAttentionBackend,
    attn: AttentionMetadata,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pool: torch.Tensor,
) -> torch.Tensor:
    """Every layer's attention for the step; the last layer's output."""
    out = qkv[0]
    for layer in range(LAYERS):
        out = backend.forward(layer, *qkv, pool, attn)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    dtype = TORCH_DTYPES[args.dtype]
    backends = {name: CpuAttentionBackend(name) for name in ("grouped", "native")}
    copy_gb_s = measure_memory_bandwidth_gb_s()
    print(f"{'seqs':>4s} {'context':>7s} {'KV MB':>6s} {'torch ms':>9s} {'ours ms':>8s} "
          f"{'torch GB/s':>10s} {'ours GB/s':>9s} {'ratio':>6s} {'max diff':>9s}")  # fmt: skip
    for context in args.context:
        for num_seqs in args.seqs:
            layout, pool = make_step(num_seqs, context, dtype)
            gen = torch.Generator().manual_seed(num_seqs)
            q = torch.randn(num_seqs, HEADS, HEAD_DIM, generator=gen).to(dtype)
            k, v = (
                torch.randn(num_seqs, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in "kv"
            )
            kv_bytes = sum(layout.context_lens) * pool[0, :, :, 0].numel() * pool.element_size()
            ms, outs = {}, {}
            for name, backend in backends.items():
                attn = backend.build_metadata(layout, BLOCK, LAYERS, torch.device("cpu"))
                outs[name] = run_step(backend, attn, (q, k, v), pool)
                call = lambda: run_step(backend, attn, (q, k, v), pool)  # noqa: B023, E731
                ms[name] = time_per_call_us(call, args.repeats) / 1e3
            diff = (outs["grouped"].float() - outs["native"].float()).abs().max().item()
            rates = {name: kv_bytes / (t / 1e3) / 1e9 for name, t in ms.items()}
            print(f"{num_seqs:4d} {context:7d} {kv_bytes / 1e6:6.0f} {ms['grouped']:9.2f} "
                  f"{ms['native']:8.2f} {rates['grouped']:10.1f} {rates['native']:9.1f} "
                  f"{ms['grouped'] / ms['native']:5.2f}x {diff:9.1e}")  # fmt: skip
    print(f"{args.dtype}, {torch.get_num_threads()} torch threads; "
          f"copy bandwidth {copy_gb_s:.1f} GB/s (read + write, bench/floor.py)")  # fmt: skip


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    numbers = lambda text: [int(n) for n in text.split(",")]  # noqa: E731
    parser.add_argument("--seqs", type=numbers, default=[8, 16, 32, 48, 64])
    parser.add_argument("--context", type=numbers, default=[300, 700])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="bf16")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
