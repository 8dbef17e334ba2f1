"""``python -m pdserve.bench.gpu_check --tiny`` end to end on the CPU: every check runs at toy
sizes and every correctness line passes (the speed lines are shown, not judged, here)."""

from __future__ import annotations

import pytest

from pdserve.bench.gpu_check.cli import main


def test_tiny_dry_run_passes_its_correctness_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tiny", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL", "info"))]
    correctness = [line for line in lines if "greedy" in line or "logits" in line]
    # two shapes x (4 greedy variants + fp32 logits + bf16 logits)
    assert len(correctness) == 12, out
    assert all(line.startswith("PASS") for line in correctness), out
    assert any("fp32 greedy, CUDA graphs off" in line for line in correctness), out
    speed = [line for line in lines if line not in correctness]
    assert speed and all(line.startswith("info") for line in speed), out
    assert "ALL JUDGED CHECKS PASS" in out
