"""Giving back a memory-mapped model's weight pages while it idles.

A bf16 checkpoint (or a GGUF's FP32 conversion) is held as file pages of its safetensors, mapped
privately and never written: every forward reads them in, and they stay in the process's resident set
afterwards. While the baseline waits (a candidate builds, is scored against the cached reference or is
served in a server of its own), those pages are a whole checkpoint's worth of memory beside the
candidate's. madvise(MADV_DONTNEED) unmaps them from this process; the next forward faults them in
again from the kernel's page cache (or the file, once the cache has let them go). Only mappings with
no page ever written are given back: a private mapping's written page is a copy of its own (smaps
counts it as Anonymous) that would be thrown away and read again from the file, silently changing a
weight, so a mapping with one is kept whole. (Private_Dirty is no sign of a write: a file written
moments ago is dirty in the page cache until the kernel writes it back, and smaps counts that too.)
"""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")


@dataclass
class Mapping:
    """One line of /proc/self/smaps and the sizes under it that decide whether it can be given back."""

    start: int
    end: int
    path: str
    rss: int = 0  # bytes
    written: int = 0  # bytes copied on write (smaps' Anonymous within a file mapping)

    @property
    def clean_file_pages(self) -> bool:
        return self.path.startswith("/") and not self.path.endswith(" (deleted)") and self.written == 0


def mappings(smaps: str | None = None) -> list[Mapping]:
    """This process's mappings with their resident and written bytes (smaps: the file's text, for tests)."""
    text = Path("/proc/self/smaps").read_text() if smaps is None else smaps
    found: list[Mapping] = []
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            start, end, path = header.groups()
            found.append(Mapping(int(start, 16), int(end, 16), path.strip()))
        elif found and ":" in line:
            key, _, value = line.partition(":")
            if key == "Rss":
                found[-1].rss = int(value.split()[0]) * 1024
            elif key == "Anonymous":
                found[-1].written = int(value.split()[0]) * 1024
    return found


def storage_ranges(model) -> list[tuple[int, int]]:
    """[start, end) of every parameter's and buffer's storage, each storage once."""
    ranges = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            ranges[storage.data_ptr()] = storage.data_ptr() + storage.nbytes()
    return sorted(ranges.items())


def weight_mappings(model, smaps: str | None = None) -> list[Mapping]:
    """The file mappings that hold the model's weights."""
    ranges = storage_ranges(model)
    return [m for m in mappings(smaps) if m.path.startswith("/") and any(s < m.end and e > m.start for s, e in ranges)]


def release(model) -> int:
    """Unmap the resident pages of the model's never-written weight mappings from this process;
    returns the bytes given back (0 where none is mapped from a file, or off Linux)."""
    from engines.file_pages import give_back

    if not sys.platform.startswith("linux"):
        return 0
    released = 0
    for mapping in weight_mappings(model):
        if not mapping.clean_file_pages:
            log.debug("weight pages kept: %s has %d written bytes", mapping.path, mapping.written)
            continue
        if give_back(mapping.start, mapping.end - mapping.start):
            released += mapping.rss
    return released
