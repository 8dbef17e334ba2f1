"""One line per check, and the summary table at the end."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Check:
    """A measured value against its target; ``passed`` None: shown, not judged (``--tiny``
    speed figures, which say nothing about a GPU)."""

    name: str
    measured: str
    target: str
    passed: bool | None

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "info"}[self.passed]

    def line(self) -> str:
        return f"{self.verdict} {self.name}: {self.measured} (target {self.target})"


def summary_table(checks: Sequence[Check]) -> str:
    rows = [("check", "measured", "target", "result")]
    rows += [(c.name, c.measured, c.target, c.verdict) for c in checks]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
