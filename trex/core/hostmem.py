"""Host memory: keep freed memory in the process instead of handing it back to the OS after every step.

glibc's malloc serves large blocks (above a threshold that adapts up to 32 MiB) with fresh ``mmap`` pages and
returns them on ``free``, and trims the heap's free top above a threshold: a training step that allocates
and frees the same activations every step then faults every page of them in again. On the 2-vCPU VM these
numbers come from, page faults are expensive: the tiny model's CPT step on real data took 1.375 s (median of
4 runs, 1.26-1.47) with ~650 k minor faults per 12-step run, 1.266 s (1.23-1.29) with ~290 k once freed memory
stays (2026-12-04, ``docs/operations.md``).

:func:`keep_freed_memory` sets ``M_MMAP_THRESHOLD`` to 32 MiB (glibc's maximum: larger blocks are still mapped
and unmapped), ``M_TRIM_THRESHOLD`` to 2 GiB and ``M_TOP_PAD`` to 64 MiB in this process (``mallopt``), and
the same ``MALLOC_*_`` variables for the processes it starts (torchrun ranks read them when they load glibc).
The price: the resident set stays near its peak instead of shrinking between steps. Nothing is changed where
the user set any of these variables, with ``TREX_MALLOC=default``, or off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

MMAP_THRESHOLD = 32 << 20  # glibc accepts at most HEAP_MAX_SIZE / 2 (32 MiB on 64-bit)
TRIM_THRESHOLD = (1 << 31) - 1  # (an int for mallopt)
TOP_PAD = 64 << 20
ENV = {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, "MALLOC_TRIM_THRESHOLD_": TRIM_THRESHOLD,
       "MALLOC_TOP_PAD_": TOP_PAD}
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # malloc.h


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl has no mallopt)
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_memory(environ: dict | None = None) -> bool:
    """Apply the settings above to this process and to ``environ`` (default ``os.environ``, inherited by the
    processes started later); False (nothing changed) where the user chose otherwise or malloc is not glibc's."""
    env = os.environ if environ is None else environ
    if env.get("TREX_MALLOC", "").strip().lower() == "default" or any(k in env for k in ENV):
        return False
    libc = _glibc()
    if libc is None:
        return False
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD)))
    if ok:
        env.update({k: str(v) for k, v in ENV.items()})
    return ok
