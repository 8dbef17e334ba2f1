"""The KV tiers benchmark runs end to end (smoke size): every configuration answers every
request, and with the pool too small for the working set the tiers raise the prefix hits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench import kv_tiers

pytestmark = pytest.mark.slow


def test_quick_run_reports_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    assert kv_tiers.main(["--quick", "--json", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    tiered = {"host exact", "host int8", "disk exact", "disk int8"}
    assert set(rows) == {"pool only"} | tiered
    for name in tiered:
        assert rows[name]["prefix_hit_rate"] > rows["pool only"]["prefix_hit_rate"], name
    for name in ("pool only", "host exact", "disk exact"):
        assert rows[name]["same_first_tokens"] == 1.0, name
    assert rows["host int8"]["tier_mb"] < rows["host exact"]["tier_mb"] / 3, "fp32 vs int8"
