"""The KV tiers benchmark runs end to end (smoke size): every configuration answers every
request, and with the pool too small for the working set the tiers raise the prefix hits;
the peer fetch rows come from a real cluster, where a fetched prefix gives the holder's
tokens and no fetch falls back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench import kv_tiers

pytestmark = pytest.mark.slow


def _rows(tmp_path: Path, *args: str) -> dict[str, dict[str, object]]:
    out = tmp_path / "rows.json"
    assert kv_tiers.main(["--quick", *args, "--json", str(out)]) == 0
    return {str(r["config"]): r for r in json.loads(out.read_text())}


def test_quick_run_reports_every_configuration(tmp_path: Path) -> None:
    rows = _rows(tmp_path, "--tiers-only")
    tiered = {"host exact", "host int8", "disk exact", "disk int8"}
    loads = {f"load from {t}, {c}" for t in ("host", "disk") for c in ("exact", "int8")}
    assert set(rows) == {"pool only"} | tiered | loads
    for name in tiered:
        assert rows[name]["prefix_hit_rate"] > rows["pool only"]["prefix_hit_rate"], name
    for name in ("pool only", "host exact", "disk exact"):
        assert rows[name]["same_first_tokens"] == 1.0, name
    assert rows["host int8"]["tier_mb"] < rows["host exact"]["tier_mb"] / 3, "fp32 vs int8"
    assert all(rows[name]["load_ms_per_block"] > 0 for name in loads)


def test_quick_peer_fetch_rows(tmp_path: Path) -> None:
    rows = _rows(tmp_path, "--peer-only")
    fetch = rows["prefix fetched vs recomputed"]
    assert fetch["same_tokens"] == 1.0, "a fetched prefix gives the holder's own tokens"
    assert fetch["fetched_mb"] == pytest.approx(64 * 737_280 / 1e6), "1,024 fp32 tokens"
    for name in ("without peer fetch", "with peer fetch"):
        assert rows[name]["requests"] == 2 * 9 and rows[name]["fetch_fallbacks"] == 0, name
    assert rows["without peer fetch"]["fetches"] == 0
