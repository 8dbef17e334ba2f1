"""The speculative decoding benchmark runs end to end (smoke size) and checks, as it goes,
that every configuration produced the very same tokens as speculation off."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.bench import speculative


def test_quick_run_reports_every_workload_and_configuration(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    assert speculative.main(["--quick", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {(r["workload"], r["config"]) for r in rows} == {
        (w, c) for w in ("copy", "chat", "batch32") for c in speculative.CONFIGS
    }
    by_key = {(r["workload"], r["config"]): r for r in rows}
    assert by_key["copy", "off"]["speedup"] == 1.0
    # prompt lookup finds the paragraph it is asked to repeat
    assert by_key["copy", "ngram-chain"]["acceptance_length"] > 1.0
    assert all(r["goodput_rps"] is not None for r in rows if r["workload"] == "batch32")
