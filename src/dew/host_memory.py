"""Host memory: keep XLA:CPU's per-execution temporaries in memory that is already mapped.

XLA:CPU allocates all temporaries of one execution as a single block (146 MB for the step of
benchmarks/diffusion_train.py) and frees it when the execution ends. The allocation happens on one
of XLA's worker threads, and glibc's malloc serves a block that large from a thread's arena with a
fresh ``mmap`` (a thread arena cannot grow past 64 MB, and the main arena maps anything above
32 MB), which ``free`` unmaps again. So every step touches all of that memory anew: ~36,000 minor
page faults per diffusion training step, half of the process's CPU time spent in the kernel.

`reuse_freed_memory` tells glibc (``mallopt``) to use one arena, never to ``mmap`` a chunk, and to
return freed memory to the system only above 2 GB of free heap, so the block is carved from the
heap once and reused by every later step. Measured in one process (benchmarks/README.md):
diffusion training +30%, decoder training +30%, page faults per step from ~36,000 to ~0. The price
is that the process keeps its peak heap, which a training process does anyway.

``import dew`` applies it on Linux with glibc, before JAX starts its worker threads (a thread keeps
the arena it first allocated from, so importing Dew after JAX has run something helps only
threads started later). ``DEW_HOST_MEMORY=system`` in the environment keeps glibc's defaults.
Other C libraries and systems are left as they are.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

TRIM_THRESHOLD = 2**31 - 1  # bytes of free heap kept before any is returned (mallopt takes an int)
ENV = "DEW_HOST_MEMORY"

applied = False  # whether this process runs with the settings above


def on_glibc_linux() -> bool:
    """Whether this process runs on Linux with glibc (the only place the settings apply)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError):  # a C library without the glibc extension
        return False


def reuse_freed_memory() -> bool:
    """Apply the settings above where they apply; returns whether they are in effect."""
    global applied
    if applied:
        return True
    choice = os.environ.get(ENV, "reuse").strip().lower()
    if choice not in ("reuse", "system"):
        raise ValueError(
            f"{ENV}={os.environ[ENV]!r} is not a known setting; use 'reuse' (the default: keep "
            "XLA's per-step temporaries mapped) or 'system' (glibc's own malloc settings)"
        )
    if choice == "system" or not on_glibc_linux():
        return False
    libc = ctypes.CDLL(None)  # the process's own symbols, glibc's mallopt among them
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    applied = all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)
    return applied
