"""The time a build may still take. The race runs each candidate's build in a process of its own and
ends that process when the candidate's budget runs out; inside it, the build's own searches (NNCF's
accuracy control, the sensitivity fallback) read this deadline to stop early with the best they have
found, leaving time to write it, instead of being cut with nothing. Outside a race there is none."""

from __future__ import annotations

import time
from typing import Optional

_window: Optional[tuple[float, float]] = None  # (start, end) on time.monotonic()


def set_window(seconds: float) -> None:
    """From now, `seconds` to build in (called in the build's own process)."""
    global _window
    now = time.monotonic()
    _window = (now, now + seconds)


def clear() -> None:
    global _window
    _window = None


def soft_end(share: float) -> Optional[float]:
    """The monotonic time by which a search should stop: `share` of the window from its start (the rest
    is kept for writing what it found); None without a deadline."""
    if _window is None:
        return None
    start, end = _window
    return start + share * (end - start)


def past(share: float) -> bool:
    """True once `share` of the window has gone by (never without a deadline)."""
    end = soft_end(share)
    return end is not None and time.monotonic() >= end


def seconds_left() -> Optional[float]:
    """Seconds until the window ends (negative past it); None without a deadline."""
    if _window is None:
        return None
    return _window[1] - time.monotonic()


def window_s() -> Optional[float]:
    """The window's length; None without a deadline."""
    return None if _window is None else _window[1] - _window[0]
