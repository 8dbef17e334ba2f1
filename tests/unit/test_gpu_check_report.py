"""gpu_check's bookkeeping: a section that raises is a failed check and the run goes on."""

from __future__ import annotations

import pytest

from pdserve.bench.gpu_check.cli import Run
from pdserve.bench.gpu_check.report import Check, summary_table


def test_a_raising_section_fails_and_the_run_goes_on(capsys: pytest.CaptureFixture[str]) -> None:
    run = Run()
    run.section("broken", lambda: [1 // 0])  # type: ignore[list-item]
    run.section("fine", lambda: [Check("fine", "1.0x", ">= 1x", True)])
    assert [(c.name, c.passed) for c in run.checks] == [("broken", False), ("fine", True)]
    assert "ZeroDivisionError" in run.checks[0].measured
    assert "FAIL broken: raised ZeroDivisionError" in capsys.readouterr().out


def test_summary_table_lines_up_every_check() -> None:
    checks = [Check("a", "1", "t", True), Check("long name", "22", "t", None)]
    lines = summary_table(checks).splitlines()
    assert [line.split()[-1] for line in lines] == ["result", "------", "PASS", "info"]
    assert len({line.index(line.split()[-1]) for line in lines[2:]}) == 1
