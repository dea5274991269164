"""Keep freed memory for reuse instead of handing it back to the kernel.

glibc serves every allocation over its mmap threshold (32 MiB at most) with a fresh
``mmap`` and returns it with ``munmap`` when freed. A CPU training loop frees and
reallocates its logits, activations and gradients every micro-batch, so each time the
kernel maps and zeroes those pages again, and on the GRPO policy worker system time and
page faults become a large share of its CPU time. Serving large blocks from the heap, and not
trimming it, lets the next micro-batch reuse the same pages. The price: the process keeps
its peak footprint (its resident size no longer falls between phases). Reuse depends on
the heap's layout: in a Ray worker process, where phalanx calls this, a freed block is
served again; in a bare process, torch's aligned blocks may still be placed on new pages.
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 1 << 30


def reuse_freed_memory() -> bool:
    """Make glibc keep freed large blocks for reuse (see the module docstring). Returns
    whether it did: False off Linux or with another C library (then nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
