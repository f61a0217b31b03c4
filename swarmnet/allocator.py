"""keep_freed_memory: glibc's allocator keeps freed tensor memory for the next step instead of giving it back to the OS.

A forward allocates and frees tensors of a few MB at every layer (a prefill's MLP activations, attention scores, a
batch's logits). glibc serves allocations above its mmap threshold (128 KiB at start, raised as it sees such blocks
freed, but never past what it last saw) with a fresh mmap, and gives memory at the top of its heap back to the OS
above its trim threshold; either way the next step's tensor is new memory, which the kernel zeroes page by page. On a
2-core VM, 15 SmolLM2 blocks prefilling and decoding 4 lanes of 21 rows spent 1.18 s in the kernel (698,000 page
faults) for 11 s of compute; with these settings 0.01 s and 3,822, and 1.10x the wall time (bench/allocator.py).

The price: a process keeps the memory of its biggest steps (up to the trim threshold above what it holds) instead of
returning it between steps. Set SWARMBATCH_MALLOC_TUNING=0 to keep glibc's defaults. Elsewhere than glibc (musl's
mallopt does nothing; macOS has none) nothing changes.
"""
from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest on 64-bit: blocks up to this size come from the heap, reused
TRIM_THRESHOLD = 256 * 1024 * 1024  # free memory at the heap's top is given back only above this
OFF_VALUES = {"0", "false", "no", "off"}


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True where they were set (glibc, not turned off)."""
    if os.environ.get("SWARMBATCH_MALLOC_TUNING", "1").strip().lower() in OFF_VALUES:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on (no lookup, no subprocess)
    except (OSError, AttributeError):  # one without mallopt (not glibc)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
