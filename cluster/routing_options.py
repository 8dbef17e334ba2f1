"""Routing flags shared by `pdserve up`, `pdserve join --router` and `pdserve router`.

``--policy`` names the default routing policy; ``--no-link-aware`` makes that policy blind
to the links between workers: every (prefill, decode) pair is priced at the cost model's
default KV rate instead of the rate the router measured on it (``RouterConfig.link_aware``).
"""

from __future__ import annotations

import argparse
from typing import Any


def add_routing_arguments(parser: argparse.ArgumentParser, policy_help: str) -> None:
    add = parser.add_argument
    add("--policy", default=None, help=policy_help)
    add("--link-aware", action=argparse.BooleanOptionalAction, default=True,
        help="price each (prefill, decode) pair's KV transfer at the rate measured on that "
        "link; --no-link-aware: every pair at the default rate (default: on)")  # fmt: skip


def routing_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``RouterConfig`` fields the flags give."""
    fields: dict[str, Any] = {"link_aware": args.link_aware}
    if args.policy:
        fields["default_policy"] = args.policy
    return fields
