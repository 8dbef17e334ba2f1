"""How `pdserve up` and `pdserve router` take the cluster secret, API keys and TLS: from files
named by flags or PDSERVE_* variables, never as values; and what `pdserve up` does with them."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
from pathlib import Path

import pytest

from pdserve.cluster.cli import build_parser
from pdserve.cluster.cli_up import build_up_config
from pdserve.cluster.router_start import RedisRouterSpec
from pdserve.cluster.secret import SecretSource, cluster_secret, ray_token_auth, secret_source
from pdserve.cluster.settings import Settings
from pdserve.worker.cluster_secret import ClusterSecret, read_secret_file, write_secret_file
from pdserve.worker.server import build_parser as worker_parser
from pdserve.worker.server import configs_from_args
from pdserve.worker.server import main as worker_main

KEY = "sk-front-door-test-key"


def _up(*flags: str) -> argparse.Namespace:
    args, _extra = build_parser().parse_known_args(["up", *flags])
    return args


def _keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(f"# the clients' keys\n\n  {KEY}  \nsk-second\n")
    return path


def test_up_secures_the_inside_by_default_with_a_new_secret_beside_the_state_file(
    tmp_path: Path,
) -> None:
    state = tmp_path / "up.json"
    config = build_up_config(_up("--state-file", str(state)), Settings.from_env())
    assert config.secret == SecretSource(tmp_path / "up.secret", False, tmp_path / "up.ray-token")
    given = build_up_config(
        _up("--state-file", str(state), "--cluster-secret-file", str(tmp_path / "s")),
        Settings.from_env(),
    )
    assert given.secret is not None and (given.secret.path, given.secret.given) == (
        tmp_path / "s",
        True,
    )
    assert build_up_config(_up("--no-cluster-auth"), Settings.from_env()).secret is None
    with pytest.raises(ValueError, match="contradicts"):
        build_up_config(_up("--no-cluster-auth", "--cluster-secret-file", "x"), Settings.from_env())


def test_api_keys_and_tls_come_from_files_named_by_flags(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("cert"), key.write_text("key")
    flags = ("--api-keys-file", str(_keys_file(tmp_path)), "--tls-cert", str(cert))
    router = build_up_config(_up(*flags, "--tls-key", str(key)), Settings.from_env()).router
    assert router.api_keys == (KEY, "sk-second")
    assert (router.tls_cert_path, router.tls_key_path) == (str(cert), str(key))
    assert KEY not in repr(router)
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        build_up_config(_up(*flags), Settings.from_env())


def test_the_same_come_from_pdserve_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("cert"), key.write_text("key")
    env = {
        "PDSERVE_API_KEYS_FILE": str(_keys_file(tmp_path)),
        "PDSERVE_TLS_CERT": str(cert),
        "PDSERVE_TLS_KEY": str(key),
        "PDSERVE_CLUSTER_SECRET_FILE": str(tmp_path / "secret"),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for command in ("up", "router"):
        args, _ = build_parser().parse_known_args([command])
        assert (args.api_keys_file, args.tls_cert, args.tls_key) == (
            Path(env["PDSERVE_API_KEYS_FILE"]),
            cert,
            key,
        )
        assert args.cluster_secret_file == tmp_path / "secret"
    router = build_up_config(_up(), Settings.from_env()).router
    assert router.api_keys == (KEY, "sk-second") and router.tls_key_path == str(key)


def test_an_empty_or_missing_keys_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        build_up_config(_up("--api-keys-file", str(empty)), Settings.from_env())
    with pytest.raises(ValueError, match="No such file"):
        build_up_config(_up("--api-keys-file", str(tmp_path / "nope")), Settings.from_env())


def test_a_new_secret_lives_as_long_as_the_cluster_a_given_one_stays(tmp_path: Path) -> None:
    source = secret_source(None, tmp_path / "up.json")
    with cluster_secret(source) as secret:
        assert secret is not None and read_secret_file(source.path) == secret
        assert (source.path.stat().st_mode & 0o777) == 0o600
    assert not source.path.exists()
    given = tmp_path / "kept.secret"
    with cluster_secret(secret_source(given, tmp_path / "up.json")) as made:
        assert made is not None and read_secret_file(given) == made  # made where asked
    with cluster_secret(secret_source(given, tmp_path / "up.json")) as secret:
        assert secret == made  # and kept for the next start (or another host)
    assert given.exists()
    with cluster_secret(None) as nothing:
        assert nothing is None


def test_ray_gets_the_secrets_token_from_a_private_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    secret = ClusterSecret.generate()
    source = secret_source(None, tmp_path / "up.json")
    with ray_token_auth(secret, source):
        assert os.environ["RAY_AUTH_MODE"] == "token"
        token_file = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
        assert token_file.read_text() == secret.ray_token()
        assert (token_file.stat().st_mode & 0o777) == 0o600
        assert "RAY_AUTH_TOKEN" not in os.environ  # the token itself is in no variable
    assert "RAY_AUTH_MODE" not in os.environ and not token_file.exists()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the user's choice stands
    with ray_token_auth(secret, source):
        assert os.environ["RAY_AUTH_MODE"] == "disabled" and not source.ray_token_file.exists()


def test_the_worker_server_takes_the_secret_from_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cluster.secret"
    secret = ClusterSecret.generate()
    write_secret_file(path, secret)
    flags = ["--role", "decode", "--kv-backend", "tcp", "--cluster-secret-file", str(path)]
    server, _engine, transfer, _decode = configs_from_args(worker_parser().parse_args(flags))
    assert server.secret == secret and transfer.auth_key == secret.kv_transfer_key()
    assert secret.to_text() not in repr(server) and "auth_key" not in repr(transfer)
    plain, _engine, open_transfer, _decode = configs_from_args(
        worker_parser().parse_args(["--role", "decode"])
    )
    assert plain.secret is None and open_transfer.auth_key is None
    os.chmod(path, 0o640)
    assert worker_main(flags) == 2
    assert "accessible by group or others (mode 0640)" in capsys.readouterr().err


def test_configs_that_carry_credentials_hide_them_from_repr(tmp_path: Path) -> None:
    secret = ClusterSecret.generate()
    url = "redis://:the-redis-password@127.0.0.1:6379/0"
    config = build_up_config(
        _up("--redis-url", url, "--api-keys-file", str(_keys_file(tmp_path))), Settings.from_env()
    )
    spec = dataclasses.replace(config.worker.worker, cluster_secret=secret)
    launch = dataclasses.replace(config.worker, worker=spec, redis_url=url)
    router = RedisRouterSpec(url, "pdserve:", 5.0, "model", secret)
    for shown in (repr(config), repr(launch), repr(router)):
        for hidden in ("the-redis-password", secret.to_text(), KEY):
            assert hidden not in shown
    assert pickle.loads(pickle.dumps(launch)).worker.cluster_secret == secret  # Ray ships it
