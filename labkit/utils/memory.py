"""Memory back to the operating system, which `del` alone does not give.

A tensor freed by `del` returns to the C allocator, not to the system. glibc serves blocks
below its mmap threshold from its heap and keeps them there when freed, for reuse; the
threshold rises (up to 32 MiB) to the size of each larger block freed, so a model's weights
and activations soon fall under it. The process's resident memory then stays at its peak
until the heap happens to be reused. `trim` hands the heap's free pages back (glibc's
malloc_trim); `release` collects the garbage (objects in reference cycles) first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


LIBC = _libc()  # the C library on Linux (glibc or musl), else None; labkit.utils.pages uses it


def trim() -> bool:
    """Give the C heap's free pages back to the system; whether the allocator could (glibc)."""
    if not hasattr(LIBC, "malloc_trim"):  # (musl has none)
        return False
    LIBC.malloc_trim(0)
    return True


def release() -> bool:
    """Collect Python's garbage (objects in reference cycles), then `trim`."""
    gc.collect()
    return trim()
