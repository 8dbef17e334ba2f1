"""Every Triton kernel compiles, for an H100 (sm_90), on a machine without a GPU.

The interpreter tests (test_triton_attention.py, test_triton_fused_ops.py) check what the
kernels compute but run them as Python: they cannot see what only the compiler rejects or
changes (control flow, ``tl.dot``'s shape and type rules, constexpr branches). Here each
kernel goes through Triton's whole pipeline down to a cubin (``ptxas`` ships with Triton),
at the shapes of a Llama-3-8B-like model (32 query heads over 8 kv heads of 128 values,
blocks of 16) with the backend's default tiles and warps; nothing runs.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from pdserve.engine.attention.triton import TritonTiles
from tests.triton_interpreter import require_triton

H100 = ("cuda", 90, 32)
TILES, GROUP = TritonTiles(), 4
ATTENTION = {"BLOCK_SIZE": 16, "GROUP": GROUP, "HEAD_DIM": 128, "BLOCK_D": 128}
INDEX_POINTERS_I64 = ("slot_ptr", "ancestors_ptr")
FP32_POINTERS = ("partial_out_ptr", "partial_lse_ptr")
FLOAT_SCALARS = ("scale_log2", "eps")


def kernel(module: str, name: str) -> Any:
    """``module.name``, compiled-mode (skipped when Triton is absent or interpreting)."""
    require_triton()
    found = getattr(importlib.import_module(module), name)
    if type(found).__name__ != "JITFunction":
        pytest.skip("TRITON_INTERPRET is set in this process: kernels are not compiled")
    return found


def compile_for_h100(
    fn: Any, dtype: str, constexprs: dict[str, object], pool: str = "", num_warps: int = 4
) -> Any:
    """Compile ``fn`` with tensors of ``dtype`` (``pool``: the pool's, if another)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def arg_type(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if not name.endswith("_ptr"):
            return "fp32" if name in FLOAT_SCALARS else "i32"
        if name == "pool_ptr":
            return f"*{pool or dtype}"
        if name in FP32_POINTERS:
            return "*fp32"
        if name in INDEX_POINTERS_I64:
            return "*i64"
        is_index = name.endswith(("tables_ptr", "start_ptr", "pos_ptr", "len_ptr", "chunks_ptr"))
        return "*i32" if is_index or name == "is_tree_ptr" else f"*{dtype}"

    signature = {name: arg_type(name) for name in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton_compile(source, target=GPUTarget(*H100), options={"num_warps": num_warps})


def dot_constants(dtype: str, int8_pool: bool = False) -> dict[str, object]:
    """The key tile and the ``tl.dot`` constants the backend launches ``dtype`` queries with."""
    key_tile = TILES.key_tile(torch.float32 if dtype == "fp32" else torch.bfloat16)
    return {"BLOCK_KEYS": key_tile, "PRECISION": "ieee" if dtype == "fp32" else None,
            "DOT_FP32": False, "INT8_ROWS": int8_pool}  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "trees", "pool"), [("bf16", True, ""), ("fp32", False, ""), ("fp16", False, "i8")]
)
def test_prefill_compiles(dtype: str, trees: bool, pool: str) -> None:
    fn = kernel("pdserve.engine.attention.triton.prefill", "_prefill_kernel")
    constants = ATTENTION | {
        "TILE_TOKENS": TILES.query_rows // GROUP,
        "BLOCK_ROWS": TILES.query_rows,
        "HAS_TREES": trees,
    }
    constants |= dot_constants(dtype, bool(pool))
    compiled = compile_for_h100(fn, dtype, constants, pool, TILES.num_warps)
    # 16-bit tiles run on tensor cores (wgmma on sm_90); fp32 ("ieee") on the FMA units.
    assert ("mma" in compiled.asm["ptx"]) == (dtype != "fp32")


@pytest.mark.parametrize(("dtype", "split", "pool"), [("fp32", False, ""), ("bf16", True, "i8")])
def test_decode_and_merge_compile(dtype: str, split: bool, pool: str) -> None:
    fn = kernel("pdserve.engine.attention.triton.decode", "_decode_split_kernel")
    constants = ATTENTION | {"NUM_HEADS": 32, "SPLIT": split, "BLOCK_GROUP": 16}
    constants |= dot_constants(dtype, bool(pool))
    compile_for_h100(fn, dtype, constants, pool, TILES.num_warps)
    merge = kernel("pdserve.engine.attention.triton.decode", "_merge_splits_kernel")
    compile_for_h100(merge, dtype, {"NUM_HEADS": 32, "BLOCK_SPLITS": 16, "HEAD_DIM": 128,
                                    "BLOCK_D": 128})  # fmt: skip


def test_store_and_fused_ops_compile() -> None:
    store = kernel("pdserve.engine.attention.triton.store", "_store_kv_kernel")
    compile_for_h100(store, "bf16", {"BLOCK_SIZE": 16, "KV_HEADS": 8, "HEAD_DIM": 128,
                                     "BLOCK_ELEMS": 1024})  # fmt: skip
    rms = kernel("pdserve.engine.model.triton_ops", "_rms_norm_kernel")
    compile_for_h100(rms, "bf16", {"COLS": 4096, "BLOCK": 4096})
    rope = kernel("pdserve.engine.model.triton_ops", "_rope_kernel")
    compile_for_h100(rope, "bf16", {"HEADS": 40, "HALF": 64, "BLOCK_HEADS": 64, "BLOCK_HALF": 64})
