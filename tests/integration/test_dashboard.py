"""The ops dashboard in REAL headless Chromium, against a real router with STUB workers
serving traffic, driven over the DevTools protocol (``--remote-debugging-pipe``: JSON
messages separated by NUL bytes on file descriptors 3 and 4, so no extra package is needed).

The page marks every chart canvas with ``data-points`` (points holding data); the test waits
until every chart has several, checks the page's status, and saves a screenshot. Set
``PDSERVE_DASHBOARD_SCREENSHOT=docs/img/dashboard.png`` to keep a copy (the test then lets
the page collect ~40 s of history first, for a more telling picture).
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.proto import worker_pb2
from tests.integration.stub_worker import StubCluster, StubWorker, start_stub_cluster

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Chromium: apt-get install -y chromium (see the Makefile)"
)
WINDOW = (1440, 1400)
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
    "--remote-debugging-pipe",
)
PAGE_STATE_JS = """JSON.stringify({
  polls: Number(document.body.dataset.polls),
  error: document.body.dataset.lastError ?? null,
  status: document.getElementById("status").textContent,
  points: Object.fromEntries([...document.querySelectorAll("canvas.chart")]
    .map((c) => [c.id, Number(c.dataset.points)])),
  workerRows: document.querySelectorAll("#workers-body tr").length,
  requestsOk: document.getElementById("tile-ok").textContent,
})"""


class DevToolsPipe:
    """Chromium started with ``--remote-debugging-pipe``; ``call`` sends one CDP command."""

    def __init__(self, chromium: str, user_data_dir: Path) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # The browser reads commands on fd 3 and writes replies on fd 4.
        script = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w}'
        flags = [*CHROMIUM_FLAGS, f"--user-data-dir={user_data_dir}"]
        self.proc = subprocess.Popen(
            ["bash", "-c", script, chromium, *flags, "about:blank"],
            pass_fds=(to_browser_r, from_browser_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._last_id = 0

    def call(
        self, method: str, session: str | None = None, timeout_s: float = 30.0, **params: Any
    ) -> dict[str, Any]:
        self._last_id += 1
        message: dict[str, Any] = {"id": self._last_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:  # events arrive in between: skip them
            reply = self._read(deadline, method)
            if reply.get("id") == self._last_id:
                if "error" in reply:
                    raise RuntimeError(f"CDP {method} failed: {reply['error']}")
                return dict(reply["result"])

    def _read(self, deadline: float, method: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise TimeoutError(f"no CDP reply to {method}")
            ready, _, _ = select.select([self._from_browser], [], [], remaining_s)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise EOFError(f"Chromium exited (code {self.proc.poll()}) during {method}")
                self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        return dict(json.loads(raw))

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout_s=5.0)
            self.proc.wait(timeout=10)
        except (OSError, TimeoutError, EOFError, RuntimeError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=10)
        finally:
            os.close(self._to_browser)
            os.close(self._from_browser)


async def _lively_get_stats(
    self: StubWorker, request: worker_pb2.StatsRequest, context: Any
) -> worker_pb2.WorkerStats:
    """Plausible, moving figures derived from the calls the stub has served."""
    calls = len(self.record.calls)
    prefill = self.role == "prefill"
    return worker_pb2.WorkerStats(
        worker_id=self.worker_id,
        role=self.role,
        epoch=1,
        waiting=calls % 3,
        running=len(self.reservations),
        total_blocks=512,
        free_blocks=512 - (calls * 7) % 400,
        cached_blocks=min(calls, 300),
        prefix_hit_tokens=calls * 6 if prefill else 0,
        prompt_tokens=calls * 14,
        transfer_bytes=calls * 98_304,
    )


@pytest.fixture()
def busy_cluster() -> Iterator[StubCluster]:
    with pytest.MonkeyPatch.context() as patch:  # bound when the stub servers start
        patch.setattr(StubWorker, "GetStats", _lively_get_stats)
        cluster = start_stub_cluster({"p0": "prefill", "p1": "prefill", "d0": "decode"})
    cluster.workers["d0"].knobs.token_delay_s = 0.003
    stop = threading.Event()
    traffic = threading.Thread(target=_send_traffic, args=(cluster.http_url, stop), daemon=True)
    traffic.start()
    yield cluster
    stop.set()
    traffic.join(timeout=30)
    cluster.stop()


def _send_traffic(http_url: str, stop: threading.Event) -> None:
    lengths = (4, 8, 16, 32, 12)
    with httpx.Client(timeout=30.0) as client:
        k = 0
        while not stop.is_set():
            body = {
                "model": "fake-model",
                "prompt": "q" * (5 + k % 40),
                "max_tokens": lengths[k % 5],
            }
            client.post(f"{http_url}/v1/completions", json=body)
            k += 1
            stop.wait(0.02)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    return width, height


def test_dashboard_shows_live_data_in_chromium(busy_cluster: StubCluster, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    keep = os.environ.get("PDSERVE_DASHBOARD_SCREENSHOT")
    wanted_points = 40 if keep else 5
    browser = DevToolsPipe(CHROMIUM, tmp_path / "profile")
    try:
        target = browser.call("Target.createTarget", url=f"{busy_cluster.http_url}/dashboard")
        session = browser.call("Target.attachToTarget", targetId=target["targetId"], flatten=True)
        sid = session["sessionId"]
        browser.call(  # the window's size includes no viewport guarantee: set the viewport
            "Emulation.setDeviceMetricsOverride",
            session=sid,
            width=WINDOW[0],
            height=WINDOW[1],
            deviceScaleFactor=1,
            mobile=False,
        )
        state = _wait_for_points(browser, sid, wanted_points)
        shot = browser.call("Page.captureScreenshot", session=sid, format="png")
    finally:
        browser.close()
    assert state["error"] is None and state["status"] == "live"
    assert len(state["points"]) == 11
    assert min(state["points"].values()) >= wanted_points, state["points"]
    assert state["workerRows"] == 3
    assert int(state["requestsOk"]) > 0
    png = base64.b64decode(shot["data"])
    assert _png_size(png) == WINDOW
    (tmp_path / "dashboard.png").write_bytes(png)
    if keep:
        Path(keep).write_bytes(png)


def _wait_for_points(browser: DevToolsPipe, sid: str, wanted: int) -> dict[str, Any]:
    """The page's state once every chart holds ``wanted`` points (or the last one seen)."""
    deadline = time.monotonic() + 60.0 + wanted * 1.5
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        reply = browser.call("Runtime.evaluate", session=sid, expression=PAGE_STATE_JS)
        value = reply["result"].get("value")
        if value is not None:
            state = json.loads(value)
            if state["points"] and min(state["points"].values()) >= wanted:
                return state
        time.sleep(0.5)
    return state
