"""Keeping the memory that CPU forwards free inside the process (`BatchConfig(keep_host_memory=True)`).

A packed forward on a CPU allocates its temporaries (the products' outputs run to tens of MB) and frees them at every
step. glibc's malloc gives a free heap top past its trim threshold back to the kernel and takes blocks past its mmap
threshold from fresh mappings, so the next step faults every page of them in again: a cost that grows when the
host of a virtual machine takes freed pages back. `keep_freed_host_memory` raises the trim threshold out of reach and
serves blocks up to glibc's largest mmap threshold from the heap, as `GLIBC_TUNABLES=glibc.malloc.trim_threshold=...:
glibc.malloc.mmap_threshold=...` would at start-up. It is process-wide and lasts the process: the heap then keeps its
peak.
"""

from __future__ import annotations

import ctypes
import functools
import platform

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the largest, never reached by a free heap top in practice
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest mmap threshold on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX)


def _mallopt():
    """glibc's `mallopt`, or None where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return None
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


@functools.cache
def keep_freed_host_memory() -> bool:
    """Set glibc's malloc to keep freed memory in the process (once per process). False, with nothing changed, where
    the C library is not glibc; False also where glibc refuses a value (the first one it takes stays set)."""
    mallopt = _mallopt()
    # mallopt returns 1 on success; setting either threshold also stops glibc from adjusting both on its own.
    return (mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
            and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)))  # fmt: skip
