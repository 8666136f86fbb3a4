"""The CPU path's host allocator: keep freed activation buffers for reuse.

torch's CPU tensors come from glibc's malloc, which serves blocks above its mmap threshold
(128 KiB, raised on the fly up to the largest block freed so far) with fresh mmap pages and
returns freed memory at the heap's top once it exceeds the trim threshold. A prefill chunk's
activations are megabytes per layer, so in a fresh engine process they keep arriving as new
pages: a 512-token prefill of SmolLM2-135M on 2 cores took 40-60k page faults, which showed as
elementwise ops (silu, mul, the norms' pow) running 5-15x slower than on reused memory.
Fixing both thresholds (what the dynamic rule would reach after a few large frees) keeps those
blocks in the heap. Linux with glibc only; elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 512 * 2**20  # free memory the heap keeps at its top before returning it

_done = False


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds once per process; True when they were set."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and
            mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return False
    _done = True
    logger.debug("glibc malloc: mmap threshold %d MiB, trim threshold %d MiB",
                 MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return True
