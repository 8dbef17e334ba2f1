import argparse
import dataclasses
import subprocess
import sys

import pytest
import torch

from pdserve.bench.cli import build_parser as bench_parser
from pdserve.cluster.cli import build_parser, main
from pdserve.cluster.cli_up import build_up_config
from pdserve.cluster.routing_options import routing_fields
from pdserve.cluster.settings import Settings
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.kv_cache.tier_options import parse_size_bytes
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.speculative.options import (
    add_speculative_arguments,
    speculative_config,
    speculative_flags,
)
from pdserve.worker.host import WorkerSpec
from pdserve.worker.server import build_parser as worker_parser
from pdserve.worker.server import configs_from_args
from pdserve.worker.server import main as worker_main


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


def _up_args(*flags: str) -> argparse.Namespace:
    args, _extra = build_parser().parse_known_args(["up", *flags])
    return args


def test_up_and_router_take_the_slo_and_its_admission_factor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _up_args("--slo-ttft-ms", "500", "--slo-tpot-ms", "80", "--shed-ttft-factor", "2",
                    "--adaptive-concurrency")  # fmt: skip
    router = build_up_config(args, Settings.from_env()).router
    assert (router.slo.ttft_ms, router.slo.tpot_ms, router.shed_ttft_factor) == (500, 80, 2)
    assert router.adaptive_concurrency
    plain = build_up_config(_up_args(), Settings.from_env()).router
    assert (plain.shed_ttft_factor, plain.adaptive_concurrency) == (0.0, False)
    assert main(["up", "--slo-ttft-ms", "0"]) == 2
    assert "--slo-ttft-ms and --slo-tpot-ms must be > 0" in capsys.readouterr().err


def test_up_join_and_router_take_the_link_aware_switch_on_by_default() -> None:
    assert build_up_config(_up_args(), Settings.from_env()).router.link_aware
    blind = build_up_config(_up_args("--no-link-aware", "--policy", "round_robin"),
                            Settings.from_env()).router  # fmt: skip
    assert (blind.link_aware, blind.default_policy) == (False, "round_robin")
    for command in (["join", "10.0.0.1:6379", "--router"], ["router"]):
        args, _extra = build_parser().parse_known_args([*command, "--no-link-aware"])
        assert routing_fields(args) == {"link_aware": False}


def test_up_gives_the_speculative_flags_to_decode_and_colocated_workers_only() -> None:
    args = _up_args("--speculative", "ngram", "--num-speculative-tokens", "4", "--ngram-max", "3")
    launch = build_up_config(args, Settings.from_env()).worker
    flags = ["--speculative", "ngram", "--num-speculative-tokens", "4", "--ngram-max", "3"]
    for role in ("decode", "colocated"):
        argv = launch.for_worker(role, f"{role}-0").worker.server_args()
        assert argv[-len(flags) :] == flags, argv
        _server, engine, _transfer, _decode = configs_from_args(worker_parser().parse_args(argv))
        assert engine.speculation == SpeculativeConfig(
            method="ngram", num_speculative_tokens=4, ngram_max=3
        )
    prefill = launch.for_worker("prefill", "prefill-0").worker.server_args()
    assert not any(arg.startswith(("--speculative", "--ngram")) for arg in prefill), prefill
    plain = build_up_config(_up_args(), Settings.from_env()).worker
    assert "--speculative" not in plain.for_worker("decode", "decode-0").worker.server_args()


def test_speculative_flags_rebuild_their_config() -> None:
    config = SpeculativeConfig(
        method="draft", draft_model="smollm2-135m-instruct", min_acceptance=0.25, max_tree_nodes=9
    )
    parser = argparse.ArgumentParser()
    add_speculative_arguments(parser)
    every_field = {f.name for f in dataclasses.fields(SpeculativeConfig)} - {"method"}
    assert set(vars(parser.parse_args([]))) == every_field | {"speculative"}, "a field lacks a flag"
    flags = speculative_flags(config)
    assert flags[:2] == ["--speculative", "draft"] and len(flags) == 2 + 2 * 3  # non-defaults
    assert speculative_config(parser.parse_args(flags)) == config
    assert speculative_flags(SpeculativeConfig()) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["up", "--speculative", "draft"], "needs draft_model (--draft-model)"),
        (["up", "--speculative", "ngram", "--ngram-min", "4", "--ngram-max", "3"], "ngram_max"),
        (["generate", "--prompt", "x", "--speculative", "draft"], "--draft-model"),
        (["worker", "--role", "prefill", "--speculative", "ngram"], "prefill workers never"),
    ],
)
def test_bad_speculative_flags_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"pdserve {argv[0]}: error:" in err and message in err, err


def test_worker_server_refuses_speculation_on_a_prefill_worker(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert worker_main(["--role", "prefill", "--speculative", "ngram"]) == 2
    assert "prefill workers never speculate" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["up", "generate", "worker"])
def test_help_shows_the_speculative_flags(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--speculative {off,ngram,draft}", "--draft-model NAME", "--ngram-branches N"):
        assert flag in out, (command, flag)


def test_tier_sizes_take_binary_units_or_plain_bytes() -> None:
    assert parse_size_bytes("4096") == 4096
    assert parse_size_bytes("512MiB") == 512 * 1024**2
    assert parse_size_bytes("1.5gib") == 3 * 1024**3 // 2
    for bad in ("2GB", "-1", "lots", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
            parse_size_bytes(bad)


def test_worker_server_tier_flags_reach_the_cache_config() -> None:
    argv = ["--role", "decode", "--kv-host-tier-bytes", "2GiB", "--kv-disk-tier-path", "/kv",
            "--kv-disk-tier-bytes", "512MiB", "--kv-tier-codec", "int8"]  # fmt: skip
    _server, engine, _transfer, _decode = configs_from_args(worker_parser().parse_args(argv))
    assert (engine.cache.host_tier_bytes, engine.cache.disk_tier_path) == (2 * 1024**3, "/kv")
    assert engine.cache.disk_tier_bytes == 512 * 1024**2
    assert engine.cache.tier_codec == "int8"
    _server, plain, _transfer, _decode = configs_from_args(worker_parser().parse_args(argv[:2]))
    assert plain.cache == CacheConfig()


def test_up_gives_every_worker_the_tiers_and_its_own_disk_directory() -> None:
    args = _up_args(
        "--kv-host-tier-bytes", "1MiB", "--kv-disk-tier-path", "/kv", "--kv-tier-codec", "int8"
    )
    launch = build_up_config(args, Settings.from_env()).worker
    dirs = []
    for role, worker_id in [
        ("prefill", "prefill-0"),
        ("decode", "decode-0"),
        ("decode", "decode-1"),
    ]:
        argv = launch.for_worker(role, worker_id).worker.server_args()
        _server, engine, _transfer, _decode = configs_from_args(worker_parser().parse_args(argv))
        assert engine.cache.host_tier_bytes == 1024**2, role
        assert engine.cache.tier_codec == "int8", role
        dirs.append(engine.cache.disk_tier_path)
    assert dirs == ["/kv/prefill-0", "/kv/decode-0", "/kv/decode-1"]
    plain = build_up_config(_up_args(), Settings.from_env()).worker
    plain_argv = plain.for_worker("decode", "decode-0").worker.server_args()
    assert not any(arg.startswith(("--kv-host", "--kv-disk")) for arg in plain_argv), plain_argv


def _pdserve_worker_engine(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> EngineConfig:
    """The engine config ``pdserve worker ARGV`` gives its worker server (stopped there)."""
    launched: list[WorkerSpec] = []

    class Stop(Exception):
        pass

    def host(spec: WorkerSpec, _register: object) -> None:
        launched.append(spec)
        raise Stop

    monkeypatch.setattr("pdserve.worker.host.WorkerHost", host)
    with pytest.raises(Stop):
        main(["worker", "--redis-url", "redis://x", *argv])
    server_argv = launched[0].server_args()
    _server, engine, _transfer, _decode = configs_from_args(worker_parser().parse_args(server_argv))
    return engine


def test_pdserve_worker_passes_the_tier_flags_to_its_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = ["--role", "prefill", "--kv-host-tier-bytes", "64MiB", "--kv-disk-tier-path", "/kv/p0"]
    engine = _pdserve_worker_engine(monkeypatch, argv)
    assert (engine.cache.host_tier_bytes, engine.cache.disk_tier_path) == (64 * 1024**2, "/kv/p0")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["up", "--kv-host-tier-bytes", "2GB"], "'2GB' is not a size"),
        (["generate", "--prompt", "x", "--kv-disk-tier-bytes", "lots"], "'lots' is not a size"),
        (["worker", "--role", "decode", "--kv-host-tier-bytes", "-5"], "'-5' is not a size"),
        (["up", "--kv-disk-tier-bytes", "1GiB"], "give --kv-disk-tier-path"),
        (["generate", "--prompt", "x", "--kv-disk-tier-bytes", "1GiB"], "--kv-disk-tier-path"),
    ],
)
def test_bad_tier_flags_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as done:  # argparse's own errors (a bad size) exit from parsing
        code = int(str(done.code))
    assert code == 2
    err = capsys.readouterr().err
    assert f"pdserve {argv[0]}: error:" in err and message in err, err


@pytest.mark.parametrize("command", ["up", "generate", "worker"])
def test_help_shows_the_tier_flags(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--kv-host-tier-bytes SIZE",
        "--kv-disk-tier-path DIR",
        "--kv-disk-tier-bytes",
        "--kv-tier-codec {exact,int8}",
    ):
        assert flag in out, (command, flag)


def test_kv_cache_dtype_reaches_every_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--kv-cache-dtype int8``: the worker server's cache config, every worker that
    ``pdserve up`` starts (prefill, decode, colocated) and ``pdserve worker``'s server."""
    argv = ["--role", "decode", "--kv-cache-dtype", "int8"]
    _server, engine, _transfer, _decode = configs_from_args(worker_parser().parse_args(argv))
    assert engine.cache.kv_cache_dtype == "int8"
    launch = build_up_config(_up_args("--kv-cache-dtype", "int8"), Settings.from_env()).worker
    for role in ("prefill", "decode", "colocated"):
        server_argv = launch.for_worker(role, f"{role}-0").worker.server_args()
        _server, engine, _transfer, _decode = configs_from_args(
            worker_parser().parse_args(server_argv)
        )
        assert engine.cache.kv_cache_dtype == "int8", role
    default = build_up_config(_up_args(), Settings.from_env()).worker
    server_argv = default.for_worker("decode", "decode-0").worker.server_args()
    _server, engine, _transfer, _decode = configs_from_args(worker_parser().parse_args(server_argv))
    assert engine.cache.kv_cache_dtype == "auto"
    argv = ["--role", "decode", "--kv-cache-dtype", "int8"]
    assert _pdserve_worker_engine(monkeypatch, argv).cache.kv_cache_dtype == "int8"


def test_a_bad_kv_cache_dtype_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--kv-cache-dtype", "fp8"])
    err = capsys.readouterr().err
    assert "--kv-cache-dtype: invalid choice: 'fp8'" in err and "'int8'" in err, err


def test_device_flags_reach_every_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device cpu --no-cuda-graphs``: the worker server's engine config, every worker
    that ``pdserve up`` starts and ``pdserve worker``'s server; default auto, graphs on."""
    flags = ("--device", "cpu", "--no-cuda-graphs")
    argv = ["--role", "decode", *flags]
    _server, engine, _transfer, _decode = configs_from_args(worker_parser().parse_args(argv))
    assert (engine.device, engine.cuda_graphs) == ("cpu", False)
    launch = build_up_config(_up_args(*flags), Settings.from_env()).worker
    for role in ("prefill", "decode", "colocated"):
        server_argv = launch.for_worker(role, f"{role}-0").worker.server_args()
        _server, engine, _transfer, _decode = configs_from_args(
            worker_parser().parse_args(server_argv)
        )
        assert (engine.device, engine.cuda_graphs) == ("cpu", False), role
    default = build_up_config(_up_args(), Settings.from_env()).worker
    server_argv = default.for_worker("decode", "decode-0").worker.server_args()
    _server, engine, _transfer, _decode = configs_from_args(worker_parser().parse_args(server_argv))
    assert (engine.device, engine.cuda_graphs) == ("auto", True)
    engine = _pdserve_worker_engine(monkeypatch, argv)
    assert (engine.device, engine.cuda_graphs) == ("cpu", False)


def test_generate_takes_the_device_flags() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "x", "--device", "cuda:1"])
    assert (args.device, args.cuda_graphs) == ("cuda:1", True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_without_a_gpu_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "x", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "device 'cuda' asked for, but torch sees no CUDA device" in err, err
    assert "--device cpu" in err, err


def test_a_bad_device_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="device must be one of"):
        EngineConfig(device="tpu")
    config = EngineConfig.from_kwargs(device="cpu", cuda_graphs=False)
    assert (config.device, config.cuda_graphs) == ("cpu", False)
