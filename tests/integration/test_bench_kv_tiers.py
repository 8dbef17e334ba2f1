"""The KV tiers benchmark runs end to end (smoke size): every configuration answers every
request, and with the pool too small for the working set the tiers raise the prefix hits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench import kv_tiers

pytestmark = pytest.mark.slow


def test_quick_run_reports_the_three_configurations(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    assert kv_tiers.main(["--quick", "--json", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"pool only", "host tier", "disk tier"}
    assert rows["host tier"]["prefix_hit_rate"] > rows["pool only"]["prefix_hit_rate"]
    assert rows["disk tier"]["prefix_hit_rate"] > rows["pool only"]["prefix_hit_rate"]
    assert rows["pool only"]["same_first_tokens"] == 1.0
