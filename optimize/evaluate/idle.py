"""What the run holds while its baseline idles: a causal LM's baseline is its checkpoint memory-mapped,
and while a candidate builds, is scored against the cached reference or is served, the baseline is not
read; its weight pages are given back then (engines/pytorch/weight_pages.py) and read again by its
next forward. At Llama-3.2-1B's shape that is 2.1 GB beside every candidate."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)
GB = 1e9


def baseline_idles(baseline, while_what: str) -> int:
    """Give back the weight pages of `baseline` (the run's Subject, or None) where its runner can (a
    memory-mapped PyTorch model); returns the bytes given back."""
    runner = getattr(baseline, "runner", None)
    release = getattr(runner, "release_weight_pages", None)
    if release is None:
        return 0
    released = release()
    if released:
        log.info("the baseline's weight pages given back while %s: %.1f GB", while_what, released / GB)
    return released
