"""Giving a read-only file mapping's resident pages back to the kernel (madvise MADV_DONTNEED).

A file mapped read-only and never written holds nothing but the file's content: pages given back are
read again from the page cache (or the file) by the next access, with the same bytes. A loader that
copies a mapped file into buffers of its own (the native GGUF engine repacking its blocks) gives each
part's pages back once copied, so the file's pages and the copy are not both resident at the end of
the load. Only for mappings that were never written: a private mapping's written page is the only copy
of what was written (engines/pytorch/weight_pages.py checks that before it calls this)."""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys

log = logging.getLogger(__name__)

MADV_DONTNEED = 4  # Linux's value (asm-generic/mman-common.h)


def give_back(address: int, length: int) -> bool:
    """Give back the pages of [address, address + length), widened to whole pages; False where the
    kernel refused (or off Linux, where nothing is done)."""
    if not sys.platform.startswith("linux") or length <= 0:
        return False
    start = address - address % mmap.PAGESIZE
    end = address + length
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start, end - start, MADV_DONTNEED) != 0:
        log.debug("madvise failed at %#x (errno %d)", start, ctypes.get_errno())
        return False
    return True


def give_back_read_only(array) -> bool:
    """Give back the pages under a numpy.memmap opened read-only (mode "r"); refuses anything else
    (False), since a writable mapping's pages may hold what was written."""
    import numpy as np

    if not isinstance(array, np.memmap) or array.flags.writeable or array.mode != "r":
        return False
    return give_back(array.ctypes.data, array.nbytes)
