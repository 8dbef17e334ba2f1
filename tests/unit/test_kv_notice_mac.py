"""The MAC on NIXL notices (kv_transfer/notice_mac.py): sealed, checked, refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.kv_transfer import KVPoolLayout, TransferHeader
from pdserve.kv_transfer.nixl_agent import NOTIFY_DONE
from pdserve.kv_transfer.notice_mac import (
    NOTICE_MAC_BYTES,
    NoticeRefused,
    notice_mac,
    open_notice,
    seal_notice,
)

KEY, OTHER_KEY = b"k" * 32, b"o" * 32
RECEIVER = "pdkv-recv-101-0123abcd"
LAYOUT = KVPoolLayout(16, 2, 4, 2, 8, torch.float32)


def _notice(transfer_id: str = "req-1", blocks: tuple[int, ...] = (3, 4)) -> bytes:
    return NOTIFY_DONE + TransferHeader.for_layout(LAYOUT, transfer_id, blocks, False).encode()


def test_a_sealed_notice_opens_to_itself() -> None:
    notice = _notice()
    sealed = seal_notice(KEY, RECEIVER, notice)
    assert sealed == notice + notice_mac(KEY, RECEIVER, notice)
    assert len(sealed) == len(notice) + NOTICE_MAC_BYTES
    assert open_notice(KEY, RECEIVER, sealed) == notice


def test_without_a_key_notices_go_as_they_are() -> None:
    notice = _notice()
    assert seal_notice(None, RECEIVER, notice) == notice
    assert open_notice(None, RECEIVER, notice) == notice


def test_a_notice_without_its_mac_is_refused() -> None:
    with pytest.raises(NoticeRefused, match="carries no valid MAC"):
        open_notice(KEY, RECEIVER, _notice())
    with pytest.raises(NoticeRefused, match="too short"):
        open_notice(KEY, RECEIVER, NOTIFY_DONE + b"x" * 31)


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(lambda n: seal_notice(OTHER_KEY, RECEIVER, n), id="another key"),
        pytest.param(lambda n: seal_notice(KEY, "pdkv-recv-102-0123abcd", n), id="other receiver"),
        pytest.param(
            lambda n: b"F" + seal_notice(KEY, RECEIVER, n)[1:], id="kind changed (done to failed)"
        ),
        pytest.param(
            lambda n: _notice("req-2") + notice_mac(KEY, RECEIVER, n), id="another transfer id"
        ),
        pytest.param(
            lambda n: _notice(blocks=(3, 5)) + notice_mac(KEY, RECEIVER, n), id="other blocks"
        ),
        pytest.param(lambda n: seal_notice(KEY, RECEIVER, n)[:-1], id="mac cut short"),
    ],
)
def test_a_forged_or_changed_notice_is_refused(forge: Callable[[bytes], bytes]) -> None:
    with pytest.raises(NoticeRefused):
        open_notice(KEY, RECEIVER, forge(_notice()))


def test_the_receiver_name_is_length_prefixed_in_the_mac() -> None:
    """A name and a notice cannot trade bytes and keep the MAC."""
    notice = _notice()
    assert notice_mac(KEY, RECEIVER + "D", notice[1:]) != notice_mac(KEY, RECEIVER, notice)
