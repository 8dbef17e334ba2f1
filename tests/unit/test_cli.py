import pytest

from pdserve.cluster.cli import build_parser, main


def test_bench_offline_passes_the_rest_to_the_engine_benchmark() -> None:
    args = build_parser().parse_args(
        ["bench", "--offline", "--dtype", "bf16", "--num-requests", "4"]
    )
    assert args.offline == ["--dtype", "bf16", "--num-requests", "4"]


def test_bench_without_offline_is_the_serving_benchmark() -> None:
    args = build_parser().parse_args(["bench", "--num-prompts", "3"])
    assert args.offline is None and args.num_prompts == 3


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    out = capsys.readouterr().out
    for command in ("generate", "bench", "up", "status"):
        assert f"pdserve {command}" in out or f"  {command}" in out, command


def test_bad_generate_input_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "x", "--max-tokens", "0"]) == 2
    assert "max_tokens must be >= 1" in capsys.readouterr().err
