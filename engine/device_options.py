"""The device flags, shared by every command that runs an engine (no torch: parsing only).

``add_device_arguments(parser)`` adds ``--device`` (``EngineConfig.device``) and
``--cuda-graphs/--no-cuda-graphs`` (``EngineConfig.cuda_graphs``); ``device_settings(args)``
gives those fields; ``device_flags(settings)`` turns them back into flags, for a command
that starts workers.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from pdserve.engine.config import DEVICES, EngineConfig

_DEFAULTS = EngineConfig()


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default=_DEFAULTS.device, metavar="{" + ",".join(DEVICES) + ",cuda:N}",
        help="where weights, the KV pool and sampling live: auto = cuda when torch sees a "
        "GPU, else cpu (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--cuda-graphs", action=argparse.BooleanOptionalAction, default=_DEFAULTS.cuda_graphs,
        help="replay captured CUDA graphs for decode-only steps (CUDA only; default: on)",
    )  # fmt: skip


def device_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` fields the device flags set."""
    return {"device": args.device, "cuda_graphs": args.cuda_graphs}


def device_flags(settings: Mapping[str, Any]) -> list[str]:
    """:func:`device_settings` as worker flags."""
    graphs = "--cuda-graphs" if settings["cuda_graphs"] else "--no-cuda-graphs"
    return ["--device", str(settings["device"]), graphs]
