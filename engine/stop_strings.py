"""Stop strings over streamed text, with hold-back of a possible partial match.

Text that could still turn out to be the start of a stop string is held back rather than
streamed, so a client never sees half of a stop string that is later cut off.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StopStringMatcher:
    stops: tuple[str, ...]
    include_stop: bool = False
    _pending: str = field(default="", init=False)
    stopped: bool = field(default=False, init=False)

    def feed(self, delta: str) -> str:
        """Add newly decoded text; return the part that is safe to emit now."""
        assert not self.stopped, "feed() after a stop string matched"
        text = self._pending + delta
        hit = self._first_match(text)
        if hit is not None:
            start, stop = hit
            self.stopped = True
            self._pending = ""
            return text[: start + len(stop)] if self.include_stop else text[:start]
        keep = self._partial_suffix_len(text)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back text, once the sequence ends for another reason."""
        rest, self._pending = self._pending, ""
        return rest

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            idx = text.find(stop)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        return best

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
