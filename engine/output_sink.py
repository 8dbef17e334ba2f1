"""Where one request's outputs go: written on the engine thread, read on the asyncio loop."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

END = object()  # a request's last item on its queue


@dataclass(slots=True, eq=False)
class OutputSink:
    """A request's asyncio queue and what is still open of it. Items: StepOutputs, then
    :data:`END`, or an exception that ends the stream."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]
    open_indices: set[int]
    first_only: bool = False  # prefill role: the first output ends the stream
    opened: bool = False  # the engine accepted the request

    def put(self, item: object) -> None:
        """Hand ``item`` to the loop (from any thread); dropped if the loop has closed."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            log.debug("event loop closed; output %r dropped", item)  # nobody listens any more

    def end(self) -> None:
        self.put(END)
