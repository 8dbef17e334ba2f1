"""`pdserve generate`: run the engine offline on a few prompts."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from pdserve.engine.device_options import add_device_arguments, device_settings
from pdserve.engine.kv_cache.tier_options import (
    add_kv_cache_dtype_argument,
    add_kv_tier_arguments,
    kv_tier_settings,
)
from pdserve.engine.speculative.options import add_speculative_arguments, speculative_config

DEFAULT_MODEL = "smollm2-135m-instruct"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="run the engine offline on prompts",
        description="Run the engine in this process. Without --json, tokens stream to the "
        "terminal as they are generated; with --json, one JSON object per prompt is printed, "
        "in order, with prompt_token_ids, token_ids (generated) and text.",
    )
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="model name or path (default: %(default)s)"
    )
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for more")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string; repeat for more")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_device_arguments(p)
    add_kv_cache_dtype_argument(p)
    add_kv_tier_arguments(p)
    add_speculative_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.engine import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    tiers = kv_tier_settings(args)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        **device_settings(args),
        **tiers,
        **_speculation_options(args),
    )
    prompts: list[str | list[int]] = list(args.prompt)
    if args.chat:
        prompts = [
            llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
            for text in args.prompt
        ]
    if args.json:
        for out in llm.generate(prompts, params):
            record = {
                "prompt_token_ids": out.prompt_token_ids,
                "token_ids": out.token_ids,
                "text": out.text,
                "finish_reason": out.outputs[0].finish_reason,
            }
            print(json.dumps(record, ensure_ascii=False))
        return 0
    for prompt in prompts:
        if isinstance(prompt, str):
            print(f"\033[1m{prompt}\033[0m", end="", flush=True)
        llm.generate([prompt], params, on_step=lambda s: print(s.text, end="", flush=True))
        print()
    return 0


def _speculation_options(args: argparse.Namespace) -> dict[str, Any]:
    """The speculative flags as ``LLM`` keyword options (its ``speculative`` is the method)."""
    options = dataclasses.asdict(speculative_config(args))
    options["speculative"] = options.pop("method")
    return options
