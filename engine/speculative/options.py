"""The speculative decoding flags, shared by every command that runs an engine.

``add_speculative_arguments(parser)`` adds ``--speculative`` and its knobs;
``speculative_config(args)`` builds the ``SpeculativeConfig`` they describe;
``speculative_flags(config)`` turns one back into flags, for a command that starts workers
(``pdserve up``, ``pdserve worker``). Defaults and checks stay in ``SpeculativeConfig``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.engine.speculative.config import METHODS, SpeculativeConfig

_DEFAULTS = SpeculativeConfig()


@dataclass(slots=True, frozen=True)
class _Knob:
    """One ``SpeculativeConfig`` field as a flag named after it."""

    field: str
    type: type
    metavar: str
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


_KNOBS = (
    _Knob(
        "num_speculative_tokens", int, "N",
        "deepest candidate: how many tokens past the pending one a step may verify",
    ),
    _Knob(
        "max_tree_nodes", int, "N",
        "candidates per sequence per step, over every branch of its token tree",
    ),
    _Knob(
        "max_verify_tokens", int, "N",
        "a step speculates only while every decoding sequence's one token plus all "
        "candidates fit N tokens: past that, decode is no longer bound by reading the "
        "weights and verifying costs more than it saves",
    ),
    _Knob(
        "min_acceptance", float, "X",
        "a sequence whose candidates are accepted less than X per verify step on average "
        "pauses speculating, and tries again now and then",
    ),
    _Knob(
        "ngram_min", int, "N",
        "prompt lookup: the shortest run of last tokens looked up in the earlier text",
    ),
    _Knob(
        "ngram_max", int, "N",
        "prompt lookup: the longest run of last tokens looked up; longer runs are tried "
        "first",
    ),
    _Knob(
        "ngram_branches", int, "N",
        "prompt lookup: distinct continuations of earlier occurrences, the branches of "
        "one token tree",
    ),
    _Knob(
        "draft_model", str, "NAME",
        "the draft model of --speculative draft: a model name or path whose tokenizer is "
        "the target model's (the same vocabulary)",
    ),
    _Knob(
        "draft_num_blocks", int, "N",
        "KV blocks of the draft model's own paged cache, for --speculative draft",
    ),
)  # fmt: skip


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """``--speculative`` and its knobs, in a group of their own. Knobs left out keep
    ``SpeculativeConfig``'s defaults (shown in the help)."""
    group = parser.add_argument_group(
        "speculative decoding",
        # line breaks for raw-description parsers; other parsers wrap it themselves
        "Propose candidate tokens cheaply and verify them all in one forward pass of the\n"
        "model; the output is the same as without. Decode and colocated workers speculate;\n"
        "prefill workers (they sample only the first token) never do.",
    )
    group.add_argument(
        "--speculative", choices=METHODS, default=_DEFAULTS.method,
        help="how candidates are proposed: ngram (prompt lookup: what followed earlier "
        "occurrences of the last few tokens; no extra model), draft (a smaller model, "
        "--draft-model) or off (default: %(default)s)",
    )  # fmt: skip
    for knob in _KNOBS:
        default = getattr(_DEFAULTS, knob.field)
        shown = "" if default is None else f" (default: {default})"
        group.add_argument(
            knob.flag, dest=knob.field, type=knob.type, metavar=knob.metavar,
            default=None, help=knob.help + shown,
        )  # fmt: skip


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    """The flags' ``SpeculativeConfig``; ValueError says which setting is wrong."""
    given = {k.field: getattr(args, k.field) for k in _KNOBS if getattr(args, k.field) is not None}
    try:
        return SpeculativeConfig(method=args.speculative, **given)
    except ValueError as err:
        raise ValueError(f"speculative decoding flags: {err}") from err


def speculative_flags(config: SpeculativeConfig) -> list[str]:
    """Flags that make ``speculative_config`` build ``config`` again (none when off);
    knobs at their defaults are left out."""
    if not config.enabled:
        return []
    flags = ["--speculative", config.method]
    for knob in _KNOBS:
        value = getattr(config, knob.field)
        if value != getattr(_DEFAULTS, knob.field):
            flags += [knob.flag, str(value)]
    return flags
