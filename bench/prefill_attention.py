"""Our paged prefill kernel against torch's flash kernel, side by side.

    python -m pdserve.bench.prefill_attention [--dtype fp32|bf16] [--tokens 128,512,1024,2048]
        [--prefix 0,1024]

For each chunk length n and cached prefix p, one layer of SmolLM2's attention (9 query and
3 kv heads of 64) for a chunk at position p: torch's path as the CPU backend runs it
(``cpu_prefill.py``: a causal SDPA call, and after a prefix the gather of that prefix, a
second call and the merge) and ours (``paged_prefill.c``, K/V in place in a paged pool with
a shuffled block table). Milliseconds per call (best of three rounds), GFLOP/s of the
causal work (4 x heads x head_dim per attended position) and the ratio.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

import torch

from pdserve.bench.baselines_hf import TORCH_DTYPES
from pdserve.bench.fused_ops import time_per_call_us
from pdserve.engine.attention.cpu_prefill import attend_after_prefix, attend_fresh
from pdserve.engine.attention.paged_prefill import PagedPrefillKernel, load_paged_prefill

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 2


def make_inputs(n: int, prefix: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A pool holding prefix + n positions (shuffled blocks) and the chunk's q, k, v."""
    gen = torch.Generator().manual_seed(n + prefix)
    blocks = -(-(prefix + n) // BLOCK)
    pool = torch.randn(blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    table = torch.randperm(blocks, generator=gen).to(torch.int32)
    keys = pool[table.long(), 0, 0].flatten(0, 1)[: prefix + n]  # [positions, KVH, D]
    values = pool[table.long(), 0, 1].flatten(0, 1)[: prefix + n]
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return {"pool": pool, "table": table, "q": q, "keys": keys, "values": values}


def torch_path(inputs: dict[str, torch.Tensor], prefix: int) -> torch.Tensor:
    q, keys, values = inputs["q"], inputs["keys"], inputs["values"]
    if prefix == 0:
        return attend_fresh(q, keys, values)
    cached_k = keys[:prefix].transpose(0, 1).contiguous()  # the gather the backend does
    cached_v = values[:prefix].transpose(0, 1).contiguous()
    return attend_after_prefix(q, keys[prefix:], values[prefix:], cached_k, cached_v)


def our_path(kernel: PagedPrefillKernel, inputs: dict[str, torch.Tensor], prefix: int) -> None:
    q = inputs["q"]
    out = torch.empty(q.shape[0], HEADS * HEAD_DIM, dtype=q.dtype)
    kernel(q, inputs["pool"], inputs["table"], prefix, 0, out)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    kernel = load_paged_prefill()
    if kernel is None:
        raise SystemExit("the prefill kernel could not be built here (see the warning above)")
    print(f"{'tokens':>6s} {'prefix':>6s} {'torch ms':>9s} {'ours ms':>8s} "
          f"{'torch GFLOP/s':>14s} {'ours GFLOP/s':>13s} {'ratio':>6s}")  # fmt: skip
    for prefix in args.prefix:
        for n in args.tokens:
            inputs = make_inputs(n, prefix, TORCH_DTYPES[args.dtype])
            before_ms = time_per_call_us(functools.partial(torch_path, inputs, prefix), 3) / 1e3
            after_ms = time_per_call_us(functools.partial(our_path, kernel, inputs, prefix), 3)
            after_ms /= 1e3
            attended = n * prefix + n * (n + 1) // 2
            mflop = 4 * attended * HEADS * HEAD_DIM / 1e6
            print(f"{n:6d} {prefix:6d} {before_ms:9.2f} {after_ms:8.2f} {mflop / before_ms:14.0f} "
                  f"{mflop / after_ms:13.0f} {before_ms / after_ms:5.2f}x")  # fmt: skip
    print(f"{args.dtype}, {torch.get_num_threads()} torch threads")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    numbers = lambda text: [int(n) for n in text.split(",")]  # noqa: E731
    parser.add_argument("--tokens", type=numbers, default=[128, 512, 1024, 2048])
    parser.add_argument("--prefix", type=numbers, default=[0, 1024])
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="fp32")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
