"""What the fuzz tests share: derandomized Hypothesis settings, counts per case family, and
per-block checksums of a KV pool (to show a refused input touched no block)."""

from __future__ import annotations

import zlib
from collections import Counter

import torch
from hypothesis import HealthCheck, settings


def fuzz(max_examples: int) -> settings:
    """``max_examples`` cases, the same ones every run (CI sends what a developer sent)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


class Tally:
    """Cases sent per family and outcome, over a whole module (printed by its last test)."""

    def __init__(self) -> None:
        self.cases: Counter[tuple[str, str]] = Counter()

    def add(self, family: str, outcome: str) -> None:
        self.cases[family, outcome] += 1

    def total(self) -> int:
        return sum(self.cases.values())

    def report(self) -> str:
        families = sorted({family for family, _ in self.cases})
        lines = []
        for family in families:
            outcomes = {o: n for (f, o), n in sorted(self.cases.items()) if f == family}
            lines.append(f"  {family}: {sum(outcomes.values())} {outcomes}")
        return "\n".join(lines)


def block_checksums(pool: torch.Tensor) -> list[int]:
    """crc32 of each block of ``pool`` (blocks along dim 0), read in place."""
    rows = pool.view(torch.uint8).reshape(pool.shape[0], -1).numpy()
    return [zlib.crc32(row.data) for row in rows]
