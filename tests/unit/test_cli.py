import subprocess
import sys

import pytest

from pdserve.bench.cli import build_parser as bench_parser
from pdserve.cluster.cli import main


def test_bench_offline_passes_the_rest_to_the_engine_benchmark() -> None:
    args = bench_parser().parse_args(["--offline", "--dtype", "bf16", "--num-requests", "4"])
    assert args.offline == ["--dtype", "bf16", "--num-requests", "4"]


def test_bench_without_offline_is_the_serving_benchmark() -> None:
    args = bench_parser().parse_args(["--num-prompts", "3"])
    assert args.offline is None and args.num_prompts == 3


def test_pdserve_bench_is_the_bench_program() -> None:
    # A process of its own (the product imports nothing of bench/): its --help lists the
    # benchmark's options.
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cluster.cli", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "usage: pdserve bench" in done.stdout
    assert "--offline" in done.stdout and "--num-prompts" in done.stdout


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    out = capsys.readouterr().out
    for command in ("generate", "bench", "up", "status"):
        assert f"pdserve {command}" in out or f"  {command}" in out, command


def test_bad_generate_input_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "x", "--max-tokens", "0"]) == 2
    assert "max_tokens must be >= 1" in capsys.readouterr().err
