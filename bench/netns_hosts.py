"""Hosts for the multi-host tests and benchmarks: Linux network namespaces on one bridge.

Each host is a network namespace with its own network stack (interfaces, routes, ports) and
one address; a veth pair links it to a bridge in this namespace, which gets an address of
the same /24 so that the test process reaches every host::

    this namespace: bridge pdsn-<id>-br 10.231.N.254/24
        |-- veth pdsn-<id>-<i> <==> eth0 10.231.N.<i>/24 in namespace pdsn-<id>-<name>

The /24 is one that no interface or route of this machine uses. Cutting a host off is
``ip link set <its veth> down``; slowing the link toward it, a ``tc`` token bucket filter
on that veth; making it lossy as well (this kernel has no netem), ``iptables`` rules in
the host's namespace that drop a random share of the packets its eth0 sends and receives.
Everything is torn down by ``close``: the processes still in a namespace (all of them
started by the test) are killed by pid, the namespaces (with their rules and filters),
veths and the bridge deleted. Needs root (``ip netns add``); ``skip_reason`` says why not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=check, timeout=30)


# command -> the Debian package that has it
COMMANDS = {"ip": "iproute2", "tc": "iproute2", "iptables": "iptables"}


def skip_reason(commands: Sequence[str] = ("ip",)) -> str | None:
    """Why hosts whose links ``commands`` handle cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run the test as root"
    for command in commands:
        if shutil.which(command) is None:
            return f"the {command} command ({COMMANDS[command]}) is missing"
    return None


def drop_rules(share: float, device: str = "eth0") -> list[tuple[str, ...]]:
    """iptables rules that drop ``share`` of the packets ``device`` receives and sends, each
    packet drawn alone (the ``statistic`` match)."""
    assert 0.0 < share < 1.0, f"a share of the packets, got {share}"
    drop = ("-m", "statistic", "--mode", "random", "--probability", f"{share:g}", "-j", "DROP")
    return [("INPUT", "-i", device, *drop), ("OUTPUT", "-o", device, *drop)]


def dropped_packets(listing: str) -> int:
    """The packets DROP rules have dropped, from ``iptables -L -v -x -n``: each rule's line
    starts with its packet count, then bytes, then the target."""
    rows = (line.split() for line in listing.splitlines())
    return sum(int(row[0]) for row in rows if row[2:3] == ["DROP"])


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    link: str  # the bridge end of its veth, in this namespace
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def popen(
        self, argv: Sequence[str], env: Mapping[str, str], log_path: Path
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on this host, its output in ``log_path``."""
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.namespace, *argv],
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.processes.append(proc)
        return proc

    def run(
        self, argv: Sequence[str], env: Mapping[str, str], timeout_s: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace, *argv],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def cut_off(self) -> None:
        _ip("link", "set", self.link, "down")

    def reconnect(self) -> None:
        _ip("link", "set", self.link, "up")

    def limit_inbound(self, rate: str, burst: str = "32kbit") -> None:
        """Traffic toward this host passes at most ``rate`` (tc's units: ``100mbit``): a
        token bucket of ``burst`` on the bridge end of its veth. A fast rate needs a bucket
        of at least one timer tick of it (1 ms of 10 Gbit/s: ``10000kbit``)."""
        _tc("qdisc", "replace", "dev", self.link, "root", *_token_bucket(rate, burst))

    def unlimit_inbound(self) -> None:
        _tc("qdisc", "del", "dev", self.link, "root", check=False)

    def degrade_link(self, rate: str, drop_share: float) -> None:
        """Its link at most ``rate`` each way (a token bucket on both ends of the veth), and
        ``drop_share`` of the packets lost each way; ``restore_link`` undoes both."""
        self.limit_inbound(rate)
        _tc("-n", self.namespace, "qdisc", "replace", "dev", "eth0", "root",
            *_token_bucket(rate, "32kbit"))  # fmt: skip
        for rule in drop_rules(drop_share):
            self._iptables("-A", *rule)

    def dropped_packets(self) -> int:
        """Packets the rules of ``degrade_link`` have dropped so far."""
        return dropped_packets(self._iptables("-L", "-v", "-x", "-n"))

    def restore_link(self) -> None:
        self.unlimit_inbound()
        _tc("-n", self.namespace, "qdisc", "del", "dev", "eth0", "root", check=False)
        self._iptables("-F")  # the namespace holds no rules but those

    def _iptables(self, *args: str) -> str:
        out = self.run(("iptables", *args), {}, timeout_s=30)
        if out.returncode != 0:
            raise RuntimeError(f"iptables {' '.join(args)} in {self.namespace}: {out.stderr}")
        return out.stdout

    def sent_bytes(self) -> int:
        """Bytes this host has sent over its link (received by the bridge end)."""
        return int(Path(f"/sys/class/net/{self.link}/statistics/rx_bytes").read_text())

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.namespace, check=False).stdout
        return [int(p) for p in out.split()]

    def terminate(self) -> None:
        """SIGTERM what the test started here: each stops cleanly."""
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def kill_after(self, deadline_s: float) -> None:
        """Wait until ``deadline_s`` (monotonic) for what the test started here, then SIGKILL
        every process left in the namespace, by pid (only the test started processes there)."""
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline_s - time.monotonic()))
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


class Lan:
    """Hosts on one bridge; ``close`` removes everything it made."""

    def __init__(self, names: Sequence[str]) -> None:
        self.tag = f"pdsn-{uuid.uuid4().hex[:6]}"
        self.subnet = _free_subnet()
        self.bridge = f"{self.tag}-br"
        self.hosts: dict[str, Host] = {}
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(names, start=1):
                self.hosts[name] = self._add_host(name, i)
        except BaseException:
            self.close()
            raise

    def _add_host(self, name: str, index: int) -> Host:
        namespace, link = f"{self.tag}-{name}", f"{self.tag}-{index}"
        _ip("netns", "add", namespace)
        host = Host(name, namespace, f"{self.subnet}.{index}", link)
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        _ip("link", "set", link, "master", self.bridge, "up")
        _ip("-n", namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        return host

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the other hosts together, then the first (the head: the others need it to
        leave cleanly), each within ``timeout_s``; then remove the network."""
        hosts = list(self.hosts.values())
        for group in (hosts[1:], hosts[:1]):
            for host in group:
                host.terminate()
            deadline_s = time.monotonic() + timeout_s
            for host in group:
                host.kill_after(deadline_s)
        for host in self.hosts.values():
            _ip("link", "del", host.link, check=False)
            _ip("netns", "del", host.namespace, check=False)
        _ip("link", "del", self.bridge, check=False)


def _token_bucket(rate: str, burst: str) -> tuple[str, ...]:
    return ("tbf", "rate", rate, "burst", burst, "latency", "400ms")


def _free_subnet() -> str:
    """A 10.231.N /24 that no address or route of this machine is in."""
    used = _ip("-o", "-4", "addr").stdout + _ip("-o", "-4", "route").stdout
    for n in range(200, 250):
        prefix = f"10.231.{n}"
        if f"{prefix}." not in used:
            return prefix
    raise RuntimeError("no free 10.231.N.0/24 subnet for the test hosts")


@contextlib.contextmanager
def lan(names: Sequence[str]) -> Iterator[Lan]:
    built = Lan(names)
    try:
        yield built
    finally:
        built.close()
