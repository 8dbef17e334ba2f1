"""Our packed GEMM against oneDNN's packed GEMM, side by side.

    python -m pdserve.bench.packed_gemm [--dtype fp32|bf16] [--rows 1,16,64,2048] [--layers 30]
                                [--huge-pages]

For each row count, one pass over SmolLM2's layer linears (per layer: qkv 576 -> 960, o
576 -> 576, gate and up 576 -> 1536, down 1536 -> 576; random weights packed once by each
GEMM), best of ``--repeats`` passes: milliseconds, GFLOP/s and the ratio. Decode steps run
these on 1-64 rows, prefill chunks on up to the token budget (2,048 by default). Ours is
``packed_gemm.c`` in fp32; in bf16 ``amx_gemm.c`` (AMX) or ``avx512_bf16_gemm.c`` (AVX-512
BF16 without AMX). The heap keeps freed memory, as in the engine (``engine/host_memory.py``).
``--huge-pages`` puts our packed weights side by side on huge pages, as the engine does after
packing (``gather_on_huge_pages``); without it they sit on the 4 KiB pages of the heap.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

import torch

from pdserve.bench.baselines_hf import TORCH_DTYPES
from pdserve.bench.fused_ops import time_per_call_us
from pdserve.engine.host_memory import keep_freed_memory, on_huge_pages
from pdserve.engine.model.packed_gemm import PackedGemm, gemm_for

LAYER_SHAPES = ((576, 960), (576, 576), (576, 1536), (576, 1536), (1536, 576))  # (in, out)


def pass_ours(
    gemm: PackedGemm,
    weights: list[torch.Tensor],
    packed: list[torch.Tensor],
    inputs: dict[int, torch.Tensor],
) -> None:
    for w, p in zip(weights, packed, strict=True):
        gemm.linear(inputs[w.shape[1]], p, w.shape[0], None)


def pass_onednn(
    weights: list[torch.Tensor], packed: list[torch.Tensor], inputs: dict[int, torch.Tensor]
) -> None:
    for w, p in zip(weights, packed, strict=True):
        torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    # As the engine's runner does: outputs of thousands of rows are megabytes, and fresh
    # mmap-ed pages for each would time page faults rather than the GEMMs.
    keep_freed_memory()
    dtype = TORCH_DTYPES[args.dtype]
    gemm = gemm_for(dtype)
    if gemm is None:
        raise SystemExit(f"no {args.dtype} packed GEMM here (see the warning or note above)")
    weights = [
        torch.randn(out, inp).to(dtype) for _ in range(args.layers) for inp, out in LAYER_SHAPES
    ]
    ours = [gemm.pack(w) for w in weights]
    if args.huge_pages:
        ours = on_huge_pages(ours)
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(f"{'rows':>5s} {'oneDNN ms':>10s} {'ours ms':>8s} {'oneDNN GFLOP/s':>15s} "
          f"{'ours GFLOP/s':>13s} {'ratio':>6s}")  # fmt: skip
    for rows in args.rows:
        inputs = {inp: torch.randn(rows, inp).to(dtype) for inp, _ in LAYER_SHAPES}
        run_onednn = functools.partial(pass_onednn, weights, onednn, inputs)
        run_ours = functools.partial(pass_ours, gemm, weights, ours, inputs)
        before_ms = time_per_call_us(run_onednn, args.repeats) / 1e3
        after_ms = time_per_call_us(run_ours, args.repeats) / 1e3
        rate = rows * flops_per_row / 1e6
        print(f"{rows:5d} {before_ms:10.1f} {after_ms:8.1f} {rate / before_ms:15.0f} "
              f"{rate / after_ms:13.0f} {before_ms / after_ms:5.2f}x")  # fmt: skip
    pages = "ours on huge pages" if args.huge_pages else "ours on 4 KiB pages"
    print(f"{args.layers} layers, {args.dtype}, {torch.get_num_threads()} torch threads, {pages}")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", type=lambda s: [int(n) for n in s.split(",")], default=[1, 16, 64, 2048]
    )
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="fp32")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--huge-pages", action="store_true", help="ours on huge pages")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
