"""The faults on links: the rules that make a link lossy, the count of what they dropped,
which host a worker is on, and the table that lists a fault not run with its reason."""

from __future__ import annotations

import pytest

from pdserve.bench.chaos.analysis import FaultReport, TokenErrors
from pdserve.bench.chaos.cluster import host_at
from pdserve.bench.chaos.faults import FAULTS
from pdserve.bench.chaos.run import format_table
from pdserve.bench.netns_hosts import Host, drop_rules, dropped_packets

LISTING = """\
Chain INPUT (policy ACCEPT 1520 packets, 918734 bytes)
    pkts      bytes target     prot opt in     out     source               destination
      71   101204 DROP       0    --  eth0   *       0.0.0.0/0            0.0.0.0/0            statistic mode random probability 0.05000000000

Chain FORWARD (policy ACCEPT 0 packets, 0 bytes)
    pkts      bytes target     prot opt in     out     source               destination

Chain OUTPUT (policy ACCEPT 1493 packets, 221005 bytes)
    pkts      bytes target     prot opt in     out     source               destination
       9     1044 DROP       0    --  *      eth0    0.0.0.0/0            0.0.0.0/0            statistic mode random probability 0.05000000000
"""  # noqa: E501


def test_a_lossy_link_drops_a_random_share_each_way_on_the_hosts_interface() -> None:
    drop = ("-m", "statistic", "--mode", "random", "--probability", "0.05", "-j", "DROP")
    assert drop_rules(0.05) == [("INPUT", "-i", "eth0", *drop), ("OUTPUT", "-o", "eth0", *drop)]
    with pytest.raises(AssertionError, match="a share of the packets"):
        drop_rules(5)


def test_the_dropped_packets_are_the_drop_rules_counts_in_both_directions() -> None:
    assert dropped_packets(LISTING) == 71 + 9
    assert dropped_packets(LISTING.replace("DROP", "ACCEPT")) == 0


def test_a_worker_is_on_the_host_of_its_address() -> None:
    hosts = [Host(name, f"ns-{name}", f"10.231.200.{i}", f"veth-{i}")
             for i, name in enumerate(("w1", "w2"), start=1)]  # fmt: skip
    assert host_at(hosts, "10.231.200.2:41235").name == "w2"
    with pytest.raises(LookupError, match="is on none of the hosts"):
        host_at(hosts, "10.231.200.9:1")


def test_only_the_link_faults_need_hosts_with_their_own_network() -> None:
    assert [f.name for f in FAULTS if f.needs_hosts] == ["link-cut", "slow-link"]


def test_the_table_keeps_the_faults_order_and_gives_the_reason_a_fault_was_not_run() -> None:
    kill, cut = FAULTS[0], next(f for f in FAULTS if f.name == "link-cut")
    ran = FaultReport(kill.name, 10, {"UNAVAILABLE": 2}, 8, 0, TokenErrors(), 1, 0.75,
                      0.5, 0.2, 0.5, 12.0)  # fmt: skip
    table = format_table([ran], [cut, kill], {"link-cut": "network namespaces need root"})
    header, rule, not_run, row = table.splitlines()
    assert header.startswith("| fault | requests |") and rule.startswith("|---|")
    assert not_run == f"| {cut.what} | not run: network namespaces need root | | | | | | | |"
    assert row == (f"| {kill.what} | 10 | 2 UNAVAILABLE | 8 | 0 / 0 / 0 | 1 | 75% "
                   "| 0.50 / 0.20 / 0.50 | 12 s |")  # fmt: skip
