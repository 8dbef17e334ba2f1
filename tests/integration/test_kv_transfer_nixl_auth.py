"""NIXL KV transfer with a cluster key: real NIXL agents over UCX, real pools, one process.

A NIXL receiver's connection metadata (UCX address, memory keys) leaves it only inside the
worker API (ReserveKV, under mutual TLS): its agent runs no metadata listener, which the
first test checks against a listening agent that does hand its metadata out. Whoever gets
hold of that metadata without the secret still cannot complete a transfer: every notice
must carry a MAC under the key (kv_transfer/notice_mac.py). Here an outsider agent sends
notices without a MAC or with one under another key, and a sender with another cluster's
key writes its blocks and notices: each notice is refused and counted, the expected
transfer is neither completed nor failed (no block is accepted), and the real transfer
after it completes byte for byte. A member's transfer, and ends that disagree about the
key: test_kv_transfer_auth.py, on both backends.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pdserve.kv_transfer import TransferHeader, TransferState, make_receiver
from pdserve.kv_transfer.connector import KVReceiver
from pdserve.kv_transfer.metadata import decode_peer
from pdserve.kv_transfer.nixl_agent import (
    NOTIFY_BEGIN,
    NOTIFY_DONE,
    NOTIFY_FAILED,
    Agent,
    load_nixl,
)
from pdserve.kv_transfer.notice_mac import seal_notice
from pdserve.kv_transfer.peer_process import make_pool
from tests.integration.kv_endpoints import (
    DST,
    KEY,
    LAYOUT,
    SRC,
    TIMEOUT_S,
    WRONG_KEY,
    assert_member_lands,
    kv_config,
    kv_receiver,
    kv_sender,
    transfer_id,
)

# How long a metadata request gets to be answered: the listening agent below answers in
# well under a second on this machine.
FETCH_WAIT_S = 3.0


@pytest.fixture()
def receiver() -> Iterator[tuple[KVReceiver, torch.Tensor]]:
    with kv_receiver("nixl", KEY) as built:
        yield built


def _wait_for(done: Callable[[], bool], what: str, drive: Agent | None = None) -> None:
    """Poll until ``done``; ``drive`` is an agent whose queued notices must be pushed out."""
    deadline_s = time.monotonic() + TIMEOUT_S
    while not done():
        assert time.monotonic() < deadline_s, f"timed out waiting for {what}"
        if drive is not None:
            drive.flush(0.002)
        else:
            time.sleep(0.005)


def _listening_addresses() -> set[tuple[str, int]]:
    """The IPv4 TCP (address, port) pairs this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed since listed
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    found = set()
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            local, state, inode = line.split()[1], line.split()[3], line.split()[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                hex_ip, hex_port = local.split(":")
                ip = socket.inet_ntoa(int(hex_ip, 16).to_bytes(4, "little"))
                found.add(("127.0.0.1" if ip == "0.0.0.0" else ip, int(hex_port, 16)))
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_no_port_hands_out_a_receivers_nixl_metadata() -> None:
    """NIXL's metadata listener would give any asker the agent's memory keys. A listening
    agent shows the request works; then every TCP port this process listens on (UCX's own
    included) and NIXL's default port are asked for the receiver's metadata: none answers."""
    api = load_nixl()
    before = _listening_addresses()
    endpoint = make_receiver("nixl", kv_config(KEY))
    pool = make_pool(LAYOUT, seed=3)
    endpoint.register_pool(pool)
    name = decode_peer(endpoint.connection_metadata(), "nixl").fields["agent"]
    opened = _listening_addresses() - before

    def agent(agent_name: str, listen_port: int | None) -> Any:
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=listen_port is not None,
            listen_port=listen_port or api.DEFAULT_COMM_PORT,
            backends=["UCX"],
        )
        return api.nixl_agent(agent_name, config)

    control_port = _free_port()
    control = agent(f"listening-{uuid.uuid4().hex[:8]}", control_port)
    asker = agent(f"asker-{uuid.uuid4().hex[:8]}", _free_port())
    try:
        asker.fetch_remote_metadata(control.name, "127.0.0.1", control_port)
        _wait_for(lambda: asker.check_remote_metadata(control.name), "the control's metadata")
        assert opened, "UCX listens for its connections: the probe below asks those ports"
        for host, port in sorted(opened | {("127.0.0.1", api.DEFAULT_COMM_PORT)}):
            asker.fetch_remote_metadata(name, host, port)
        time.sleep(FETCH_WAIT_S)
        assert not asker.check_remote_metadata(name)
        sent = kv_sender(KEY, "nixl")  # the receiver still serves a member
        try:
            tid = transfer_id()
            assert_member_lands(sent, endpoint, pool, tid, endpoint.expect(tid, DST))
        finally:
            sent.close()
    finally:
        endpoint.close()


def test_notices_without_a_valid_mac_are_refused_and_the_real_transfer_follows(
    receiver: tuple[KVReceiver, torch.Tensor],
) -> None:
    """An outsider that loaded the receiver's metadata: begin, done and give-up notices
    without a MAC, under another key and sealed for another receiver."""
    endpoint, pool = receiver
    before = pool.clone()
    tid = transfer_id()
    expected = endpoint.expect(tid, DST)
    outsider = Agent("outsider", kv_config(None).ucx_tls)
    sender = kv_sender(KEY, "nixl")
    try:
        remote = outsider.add_remote(decode_peer(endpoint.connection_metadata(), "nixl").blob)
        header = TransferHeader.for_layout(LAYOUT, tid, tuple(DST), int8=False).encode()
        forged = [
            forge(kind + header)
            for kind in (NOTIFY_BEGIN, NOTIFY_DONE, NOTIFY_FAILED)
            for forge in (
                lambda notice: notice,
                lambda notice: seal_notice(WRONG_KEY, remote, notice),
                lambda notice: seal_notice(KEY, f"{remote}-elsewhere", notice),
            )
        ]
        for message in forged:
            outsider.notify(remote, message)
        _wait_for(lambda: endpoint.stats().auth_refused == len(forged), "refusals", outsider)
        assert expected.state is TransferState.PENDING  # neither completed nor failed
        stats = endpoint.stats()
        assert (stats.transfers_ok, stats.transfers_failed, stats.bytes_received) == (0, 0, 0)
        assert torch.equal(pool, before)
        assert_member_lands(sender, endpoint, pool, tid, expected)
    finally:
        sender.close()
        outsider.close()


def test_a_sender_with_another_key_completes_nothing(
    receiver: tuple[KVReceiver, torch.Tensor],
) -> None:
    """Its write lands in the registered memory (UCX checks memory keys, not who writes),
    but its notices are refused: the transfer is not completed, no block is accepted, and
    the real sender's transfer overwrites those blocks and completes."""
    endpoint, pool = receiver
    intruder, member = kv_sender(WRONG_KEY, "nixl"), kv_sender(KEY, "nixl")
    try:
        tid = transfer_id()
        expected = endpoint.expect(tid, DST)
        wrote = intruder.send(tid, list(reversed(SRC)), endpoint.connection_metadata(), DST)
        assert wrote.wait(TIMEOUT_S) is TransferState.DONE  # the sender cannot tell
        _wait_for(lambda: endpoint.stats().auth_refused == 2, "begin and done refused")
        assert expected.state is TransferState.PENDING
        assert endpoint.stats().transfers_ok == 0
        assert_member_lands(member, endpoint, pool, tid, expected)
        assert endpoint.stats().auth_refused == 2
    finally:
        intruder.close()
        member.close()
