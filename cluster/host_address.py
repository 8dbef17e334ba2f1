"""This host's address as other hosts of the cluster reach it.

Every process that other hosts call (Ray's node, Redis, the router, the workers' gRPC and KV
endpoints, their metrics) binds and advertises one address per host, chosen here:

1. the address given (``--advertise-address``);
2. toward a known peer (a joining host, toward its head): the source address the kernel's
   routing picks for that peer (a UDP ``connect`` sends no packet; it only looks up the
   route);
3. otherwise (the head): the address of the interface the default route leaves by, else of
   the only non-loopback interface. Several candidates and no default route: ValueError
   naming them, so that the user picks one.

Nothing is looked up by name: ``gethostname()`` often resolves to 127.0.1.1.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address
_PROC_ROUTE = Path("/proc/net/route")


def this_host_address(given: str | None = None, toward: str | None = None) -> str:
    """The IPv4 address other hosts reach this one at (see the module docstring)."""
    if given:
        return str(ipaddress.IPv4Address(given))
    if toward:
        return route_source_address(toward)
    addresses = interface_addresses()
    default = default_route_interface()
    if default is not None and default in addresses:
        return addresses[default]
    candidates = sorted(set(addresses.values()))
    if len(candidates) == 1:
        return candidates[0]
    raise ValueError(
        f"cannot tell which address other hosts reach this one at: no default route and "
        f"{len(candidates)} non-loopback addresses {candidates}; pass --advertise-address"
    )


def route_source_address(peer: str) -> str:
    """The local address the kernel would send from to reach ``peer`` (host or host:port)."""
    host = peer.rsplit(":", 1)[0] if peer.count(":") == 1 else peer
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))  # UDP connect: a route lookup, nothing is sent
        except OSError as err:
            raise ValueError(f"no route from this host to {host}: {err}") from err
        address: str = probe.getsockname()[0]
    return address


def interface_addresses() -> dict[str, str]:
    """Interface name -> IPv4 address, for every interface that has one, loopback left out."""
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            address = ipaddress.IPv4Address(reply[20:24])
            if not address.is_loopback:
                found[name] = str(address)
    return found


def default_route_interface(route_table: str | None = None) -> str | None:
    """The interface of the IPv4 default route (``/proc/net/route``), or None."""
    text = _PROC_ROUTE.read_text() if route_table is None else route_table
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 2 and fields[1] == "00000000":
            return fields[0]
    return None


def is_wildcard(host: str) -> bool:
    """A bind-everywhere address, which no other host can call."""
    return host in ("0.0.0.0", "::", "")
