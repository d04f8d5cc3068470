"""Stop strings: the output cut at the first one, text that may begin one held back until it is known."""

from __future__ import annotations


class StopMatcher:
    """Cuts the output at the first stop string, holding back text that may be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.buffer = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Text that is safe to emit now (never part of a stop string)."""
        if not self.stops:
            return piece
        self.buffer += piece
        cut = min((i for i in (self.buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.buffer = self.buffer[:cut], ""
            return out
        keep = self.partial_suffix()
        out, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        return out

    def partial_suffix(self) -> int:
        """Length of the longest buffer suffix that is a proper prefix of a stop string."""
        for size in range(min(len(self.buffer), max(map(len, self.stops)) - 1), 0, -1):
            tail = self.buffer[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0

    def flush(self) -> str:
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out
