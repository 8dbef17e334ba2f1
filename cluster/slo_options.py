"""The service-level objective as `pdserve up` and `pdserve router` expose it.

``--slo-ttft-ms`` and ``--slo-tpot-ms`` are what the router's goodput counts (``/metrics``,
the dashboard, Redis for the autoscaler) and what its admission follows with
``--adaptive-concurrency`` (the concurrency limit, ``router/state/admission.py``);
``--shed-ttft-factor``: a request that would wait
behind queued work more than that many times the TTFT objective is refused at once (HTTP
429 with Retry-After, gRPC RESOURCE_EXHAUSTED) rather than queued to miss it.
"""

from __future__ import annotations

import argparse
from typing import Any

from pdserve.router.config import RouterConfig
from pdserve.router.observe.goodput import SloConfig

_SLO = SloConfig()
_ROUTER = RouterConfig()


def add_slo_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("service-level objective and admission")
    add = group.add_argument
    add("--slo-ttft-ms", type=float, default=_SLO.ttft_ms, metavar="MS",
        help=f"time to first token a request should meet (default {_SLO.ttft_ms:g})")  # fmt: skip
    add("--slo-tpot-ms", type=float, default=_SLO.tpot_ms, metavar="MS",
        help=f"mean time per output token after the first (default {_SLO.tpot_ms:g})")  # fmt: skip
    add("--adaptive-concurrency", action="store_true",
        help="let the router's concurrency limit follow the SLO: grown by requests that "
        "meet it, cut when they miss it; above it a request gets 429 at once (default: off, "
        "a fixed limit)")  # fmt: skip
    add("--shed-ttft-factor", type=float, default=_ROUTER.shed_ttft_factor, metavar="X",
        help="refuse (429) a request that would wait behind queued work more than X times "
        f"the TTFT objective; 0: never (default {_ROUTER.shed_ttft_factor:g})")  # fmt: skip


def slo_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``RouterConfig`` fields the flags give."""
    if args.slo_ttft_ms <= 0 or args.slo_tpot_ms <= 0:
        raise ValueError(
            f"--slo-ttft-ms and --slo-tpot-ms must be > 0, got {args.slo_ttft_ms} and "
            f"{args.slo_tpot_ms}"
        )
    slo = SloConfig(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    return {
        "slo": slo,
        "shed_ttft_factor": args.shed_ttft_factor,
        "adaptive_concurrency": args.adaptive_concurrency,
    }
