"""CommandQueue: how asyncio handlers hand work to the engine thread."""

from __future__ import annotations

import threading

import pytest

from pdserve.engine.command_queue import CommandQueue


def test_commands_run_in_order_on_the_owner_and_return_through_futures() -> None:
    commands = CommandQueue()
    ran: list[str] = []
    first = commands.submit(lambda: ran.append("a") or 1)
    second = commands.submit(lambda: ran.append("b") or 2)
    assert not first.done()  # nothing runs until the owner takes the queue
    assert commands.run_pending(wait_s=0.0) is True
    assert ran == ["a", "b"]
    assert (first.result(), second.result()) == (1, 2)


def test_an_exception_goes_to_the_caller_and_the_queue_keeps_running() -> None:
    commands = CommandQueue()
    bad = commands.submit(lambda: int("x"))
    good = commands.submit(lambda: "ok")
    assert commands.run_pending(wait_s=0.0)
    with pytest.raises(ValueError, match="invalid literal"):
        bad.result()
    assert good.result() == "ok"


def test_stop_ends_the_loop_and_leaves_later_commands_to_close() -> None:
    commands = CommandQueue()
    before = commands.submit(lambda: "before")
    commands.stop()
    after = commands.submit(lambda: "after")
    assert commands.run_pending(wait_s=None) is False
    assert before.result() == "before"
    assert not after.done()
    commands.close(RuntimeError("the engine thread has stopped"))
    with pytest.raises(RuntimeError, match="stopped"):
        after.result()
    refused = commands.submit(lambda: "late")
    with pytest.raises(RuntimeError, match="the engine thread has stopped"):
        refused.result()


def test_an_idle_owner_wakes_for_a_command_from_another_thread() -> None:
    commands = CommandQueue()
    threading.Timer(0.01, lambda: commands.submit(lambda: None)).start()
    assert commands.run_pending(wait_s=None) is True  # blocks until the command arrives


def test_nothing_queued_and_no_wait_returns_at_once() -> None:
    assert CommandQueue().run_pending(wait_s=0.0) is True
