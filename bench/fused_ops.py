"""The fused RMSNorm and RoPE against the torch code they replace, side by side.

    python -m pdserve.bench.fused_ops [--tokens 1,64,2048] [--repeats 200]

For each dtype and token count, the time per call of each op on SmolLM2's shapes (hidden
576; RoPE over the 9 query and 3 kv heads of 64, read from rows of the fused qkv output as
the model does), best of three rounds of ``--repeats`` calls, and the ratio.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch

from pdserve.engine.model.fused_ops import FusedOps, fused_ops
from pdserve.engine.model.llama import RMSNorm
from pdserve.engine.model.rope import apply_rope_torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 576, 9, 3, 64


def time_per_call_us(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    best_s = float("inf")
    for _ in range(3):
        start_s = time.perf_counter()
        for _ in range(repeats):
            fn()
        best_s = min(best_s, (time.perf_counter() - start_s) / repeats)
    return best_s * 1e6


def op_pairs(
    ops: FusedOps, dtype: torch.dtype, tokens: int
) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """name -> (torch call, fused call) on random inputs of this shape."""
    norm = RMSNorm(HIDDEN, eps=1e-5).to(dtype)
    x = torch.randn(tokens, HIDDEN).to(dtype)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, HEADS + KV_HEADS, HEAD_DIM)
    angles = torch.rand(tokens, 1, HEAD_DIM // 2) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    return {
        "rms_norm": (
            lambda: norm.torch_forward(x),
            lambda: ops.rms_norm(x, norm.weight, norm.eps),
        ),
        "rope": (lambda: apply_rope_torch(qk, cos, sin), lambda: ops.rope(qk, cos, sin)),
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    ops = fused_ops()
    if ops is None:
        raise SystemExit("the fused ops could not be built here (see the warning above)")
    print(f"{'op':9s} {'dtype':9s} {'tokens':>6s} {'torch us':>9s} {'fused us':>9s} {'ratio':>6s}")
    for dtype in (torch.float32, torch.bfloat16):
        for tokens in args.tokens:
            for name, (reference, fused) in op_pairs(ops, dtype, tokens).items():
                before = time_per_call_us(reference, args.repeats)
                after = time_per_call_us(fused, args.repeats)
                dtype_name = str(dtype).removeprefix("torch.")
                print(
                    f"{name:9s} {dtype_name:9s} {tokens:6d} {before:9.1f} {after:9.1f} "
                    f"{before / after:5.2f}x"
                )
    print(f"{torch.get_num_threads()} torch threads")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens", type=lambda s: [int(n) for n in s.split(",")], default=[1, 64, 2048]
    )
    parser.add_argument("--repeats", type=int, default=200)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
