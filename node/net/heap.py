"""Keep the network process's freed memory for its next round (glibc malloc settings).

Every round allocates the same large buffers again: the encoded vector, each decoded
part, the reduced chunk, the averaged result (hundreds of MB per round for a 100 MB
fragment). glibc's malloc serves blocks over 32 MB (and, by default, over 128 KB) with
``mmap`` and gives them back with ``munmap`` when freed, so each round the kernel maps
and zeroes those pages again: measured on the 2-vCPU test machine (4 peers x 100 MB,
``bench/allreduce.py``), that was about a fifth of an E3M0 round's CPU and the cause of
its rounds alternating between 0.55 and 0.85 s.

:func:`keep_freed_memory` tells malloc to take every block from the heap and never to
return freed heap memory to the kernel, so a round reuses the pages of the one before.
The price is that the process keeps its peak heap (a network process's peak is a few
times its largest fragment). It is called by the network process only, never by the
trainer, whose allocations are the framework's business.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_KEEP = 2**31 - 1  # the largest trim threshold mallopt takes (an int): never trim


def keep_freed_memory() -> bool:
    """Serve large blocks from the heap and keep freed heap memory (glibc only).

    Returns whether malloc took the settings; elsewhere (musl, macOS) it does nothing and
    returns False.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP))
    logger.debug("malloc keeps freed memory: %s", ok)
    return ok
