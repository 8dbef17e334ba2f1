"""The pieces of `pdserve up --head` / `pdserve join` that need no second host: the join
token, the choice of this host's address, the worker template and the join flags."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from pdserve.cluster.cli import build_parser
from pdserve.cluster.cli_join import build_join_config, check_host_name
from pdserve.cluster.host_address import (
    default_route_interface,
    is_wildcard,
    route_source_address,
    this_host_address,
)
from pdserve.cluster.join_token import JoinToken, ray_auth_env, ray_auth_token
from pdserve.cluster.ray_node import RayNode, RayNodeSpec, TokenRefused
from pdserve.cluster.settings import Settings
from pdserve.cluster.worker_agent import AgentConfig
from pdserve.cluster.worker_launch import WorkerLaunch
from pdserve.cluster.worker_template import launch_from_json, template_json
from pdserve.worker.cluster_secret import ClusterSecret
from pdserve.worker.host import WorkerSpec

TOKEN = JoinToken("redis://10.0.0.1:6400/0", "pd:", "secret-ray-token")
SECRET = ClusterSecret.generate()

ROUTES = """\
Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth1\t0000000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
eth0\t00000000\t010000C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
"""


def test_join_token_round_trips_and_is_one_opaque_word() -> None:
    text = TOKEN.encode()
    assert text.startswith("pdj1.") and len(text.split()) == 1
    assert JoinToken.decode(f"  {text}\n") == TOKEN
    assert JoinToken.decode(JoinToken("redis://h:1/0", "p:").encode()).ray_auth_token is None
    secured = JoinToken("redis://:pw@h:1/0", "p:", secret=SECRET.to_text())
    assert JoinToken.decode(secured.encode()) == secured
    assert SECRET.to_text() not in repr(secured)


@pytest.mark.parametrize("bad", ["", "pdj2.abc", "eyJhIjoxfQ"])
def test_a_wrong_token_says_what_to_copy_without_echoing_it(bad: str) -> None:
    with pytest.raises(ValueError, match="copy the whole") as err:
        JoinToken.decode(bad)
    assert bad == "" or bad not in str(err.value)


def test_a_damaged_token_is_refused() -> None:
    cut = TOKEN.encode()[:20]
    with pytest.raises(ValueError, match="damaged") as err:
        JoinToken.decode(cut)
    assert cut not in str(err.value)


def test_ray_auth_variables_follow_the_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    file = tmp_path / "join.ray-token"
    assert ray_auth_env(TOKEN, file) == {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": "secret-ray-token",
    }
    assert ray_auth_env(JoinToken("redis://h:1/0", "p:"), file) == {}
    assert not file.exists()
    # with a secret: the head's Ray token, derived here, in a file only the owner reads
    secured = JoinToken("redis://h:1/0", "p:", secret=SECRET.to_text())
    env = ray_auth_env(secured, file)
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(file)}
    assert file.read_text() == SECRET.ray_token() and file.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "abc")
    assert ray_auth_token() == "abc"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert ray_auth_token() is None


def test_this_host_address_prefers_what_was_given_then_the_route() -> None:
    assert this_host_address("10.1.2.3") == "10.1.2.3"
    with pytest.raises(ValueError):
        this_host_address("not-an-address")
    assert this_host_address(toward="127.0.0.1:6379") == "127.0.0.1"
    assert route_source_address("127.0.0.5") == "127.0.0.1"
    assert default_route_interface(ROUTES) == "eth0"
    assert default_route_interface(ROUTES.splitlines()[0]) is None
    assert is_wildcard("0.0.0.0") and not is_wildcard("10.0.0.1")


def test_the_worker_template_carries_what_hosts_share_and_nothing_of_one_host() -> None:
    head = WorkerLaunch(
        WorkerSpec("prefill", "template-0", host="10.0.0.1", port=7000, model="m",
                   dtype="bfloat16", kv_backend="tcp", extra_args=("--block-size", "32")),
        redis_url="redis://10.0.0.1:6400/0",
        agent=AgentConfig(key_prefix="pd:", lease_s=7.0),
        role_args={"decode": ("--speculative", "ngram")},
        cpu_affinity=(("prefill", (0,)),),
    )  # fmt: skip
    head = replace(head, worker=replace(head.worker, cluster_secret=SECRET))
    text = template_json(head)
    assert "10.0.0.1" not in text and "6400" not in text and "secret" not in text
    launch = launch_from_json(text, "redis://10.0.0.1:6400/0", "auto")
    assert launch.worker == WorkerSpec("prefill", "template-0", host="auto", model="m",
                                       dtype="bfloat16", kv_backend="tcp",
                                       extra_args=("--block-size", "32"))  # fmt: skip
    assert launch.agent == head.agent and launch.role_args == head.role_args
    assert launch.cpu_affinity == () and json.loads(text)["log_level"] == head.log_level


def _join_args(*argv: str) -> argparse.Namespace:
    args, _ = build_parser().parse_known_args(["join", "10.0.0.1:6379", *argv])
    return args


def test_join_flags_become_a_config() -> None:
    args = _join_args("--token", TOKEN.encode(), "--decode", "2", "--name", "gpu-b",
                      "--num-blocks", "128", "--router")  # fmt: skip
    config = build_join_config(args, Settings())
    assert config.token == TOKEN and config.name == "gpu-b"
    assert dict(config.workers) == {"prefill": 0, "decode": 2, "colocated": 0}
    assert config.worker_args == ("--num-blocks", "128")
    assert config.router is not None and config.router.host == "0.0.0.0"


def test_join_reads_its_token_from_the_file_up_wrote(tmp_path: Path) -> None:
    file = tmp_path / "up.join-token"
    file.write_text(TOKEN.encode() + "\n")
    config = build_join_config(_join_args("--token-file", str(file), "--prefill", "1"), Settings())
    assert config.token == TOKEN


def test_join_refuses_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="--token-file"):
        build_join_config(_join_args("--decode", "1"), Settings())
    with pytest.raises(ValueError, match="nothing to run"):
        build_join_config(_join_args("--token", TOKEN.encode()), Settings())
    with pytest.raises(ValueError, match="--name"):
        check_host_name("bad name")
    assert check_host_name("gpu-a.rack1") == "gpu-a.rack1"


@dataclass(slots=True, frozen=True)
class _ExitingRayStart(RayNodeSpec):
    """`ray start` replaced by a program that prints ``output`` and fails."""

    output: str = ""

    def command(self, temp_dir: str) -> list[str]:
        return [sys.executable, "-c", f"print({self.output!r}); raise SystemExit(1)"]


def _failed_start(tmp_path: Path, output: str) -> Exception:
    spec = _ExitingRayStart("10.0.0.1:6379", "10.0.0.2", "b", 1, tmp_path / "b.ray.log", output)
    with pytest.raises(Exception) as failed:
        RayNode(spec).start(timeout_s=30)
    return failed.value


def test_a_refused_token_is_named_in_one_line_and_other_failures_show_rays_output(
    tmp_path: Path,
) -> None:
    """A ValueError: the CLI prints it as one line, without a traceback."""
    refusal = (
        "ConnectionError: InvalidAuthToken: Authentication token is missing or incorrect\n"
        "ray.exceptions.AuthenticationError: ..."
    )
    refused = _failed_start(tmp_path, refusal)
    assert isinstance(refused, TokenRefused) and isinstance(refused, ValueError)
    message = str(refused)
    assert "\n" not in message and "10.0.0.1:6379" in message
    assert "the join token is wrong or stale" in message and "b.ray.log" in message
    other = _failed_start(tmp_path, "could not reach the GCS")
    assert type(other) is RuntimeError and "could not reach the GCS" in str(other)
