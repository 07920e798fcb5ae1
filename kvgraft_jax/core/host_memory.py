"""Freed host memory kept for reuse: each restore and graft reuses the pages of the one before.

glibc serves a large buffer with fresh pages from the kernel (past its mmap threshold) and gives
the heap's free top back to the kernel (past its trim threshold), so a process that restores and
grafts artifacts one after another faults in fresh pages for every restore's host buffers (34 MB
for the 270M's 8,192 tokens) and every fresh cache (151 MB), and how many depends on what ran
before: a graft's time before its query flipped between 50 and 94 ms from one run to the next.
`keep_freed_pages` raises both thresholds for this process (glibc's own
`MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824`, set from inside it). Three
processes each way on 2 cores, the median of 25 grafts at 8,192 tokens: the graft's time before
its query 45.9, 45.7, 75.9 -> 41.5, 42.7, 43.0 ms; a verified restore 40.0, 39.7, 43.6 -> 34.2,
35.8, 36.2 ms. The price: memory freed after a peak stays with the process until it exits.

The CLI (`kvgraft_jax.main`) calls it first thing in its run, before any model, cache or artifact
is allocated. A program that imports kvgraft_jax decides for its own process: call it, or set
the variables (BUILD.md).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit hosts: buffers up to it come from the heap
TRIM_THRESHOLD = 1 << 30  # free heap top kept up to this
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)

# None until `keep_freed_pages` runs; then whether it set the thresholds (reports record it).
KEPT: bool | None = None


def keep_freed_pages(environ: Mapping[str, str] = os.environ) -> bool:
    """Sets glibc's mmap and trim thresholds for this process; True if it did. Nothing where
    the environment already chooses (`MALLOC_*_` or `GLIBC_TUNABLES` naming malloc), or where the
    C library is not glibc (macOS, musl, Windows)."""
    global KEPT
    chosen = any(k.startswith("MALLOC_") and k.endswith("_") for k in environ)
    if chosen or "malloc" in environ.get("GLIBC_TUNABLES", ""):
        KEPT = False
        return KEPT
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (present in glibc only)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        KEPT = False
        return KEPT
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    KEPT = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return KEPT
