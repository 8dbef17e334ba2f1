"""The int8 KV pool benchmark runs end to end (smoke size): both pools in the same memory,
the int8 one with about twice the blocks and a larger largest batch, and the agreement
rows for every prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench import kv_int8

pytestmark = pytest.mark.slow


def test_quick_run_reports_both_pools_and_the_agreement(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    assert kv_int8.main(["--quick", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    pools = {r["pool"]: r for r in rows if "pool" in r}
    assert set(pools) == {"bfloat16", "int8"}
    base, int8 = pools["bfloat16"], pools["int8"]
    assert 1.9 < int8["blocks"] / base["blocks"] < 2.0
    assert int8["largest_batch"] >= 2 * base["largest_batch"] - 1
    assert base["throughput_vs_baseline"] == 1.0 and int8["decode_tokens_per_s"] > 0
    agreed = [r for r in rows if "leading_same_tokens" in r]
    assert len(agreed) == 2
    assert all(0 <= r["leading_same_tokens"] <= r["decoded_tokens"] == 16 for r in agreed)
    assert all(r["max_abs_logit_diff"] > 0 for r in agreed), "int8 changes the logits a little"
