"""Keep freed memory in the process on a CPU: the allocator settings ``pdpfast train`` applies.

With glibc's defaults a CPU training step frees its activations back to the kernel, and every 4 KiB
page of them faults in again on the next step: on a 2-core VM, 5,000–20,000 minor faults a step at
~2.7 µs each, up to half of a small CNN's step, and a different share in each process depending on
its allocation history (bench/README.md, "page faults"). Raising glibc's trim threshold to its
maximum and fixing the mmap threshold at its largest value (32 MiB) makes freed blocks of up to
that size be reused instead. The same as ``MALLOC_TRIM_THRESHOLD_=2147483647
MALLOC_MMAP_THRESHOLD_=33554432`` in the environment; jemalloc or tcmalloc through ``LD_PRELOAD``
(torch's CPU tuning guide) have the same aim.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

_TRIM_THRESHOLD = 2**31 - 1
_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def retain_freed_memory() -> None:
    """Make glibc keep freed memory (blocks up to 32 MiB) in the process instead of returning it.

    Changes the whole process's allocator settings (``mallopt``); memory the process has freed
    stays counted in its resident size.

    Returns:
        None.
    Raises:
        RuntimeError where the C library is not glibc, or glibc refuses the settings.
    """
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        raise RuntimeError("retain_freed_memory needs glibc (mallopt); on other C libraries preload jemalloc or "
                           "tcmalloc instead")
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    if not (libc.mallopt(m_trim_threshold, _TRIM_THRESHOLD) and libc.mallopt(m_mmap_threshold, _MMAP_THRESHOLD)):
        raise RuntimeError("glibc refused mallopt(M_TRIM_THRESHOLD / M_MMAP_THRESHOLD)")


def retain_unless_configured() -> str:
    """``retain_freed_memory`` unless the user chose an allocator or its settings; says which.

    Returns:
        "retain" when applied; otherwise why not: "user settings (MALLOC_...)" when one of glibc's
        MALLOC_* tunables is set in the environment, "preloaded <allocator>" for jemalloc/tcmalloc/
        mimalloc in ``LD_PRELOAD``, or "not glibc" where ``mallopt`` is not available.
    """
    configured = [k for k in _USER_SETTINGS if k in os.environ]
    if configured:
        return f"user settings ({', '.join(configured)})"
    preload = os.environ.get("LD_PRELOAD", "")
    for allocator in _OTHER_ALLOCATORS:
        if allocator in preload:
            return f"preloaded {allocator}"
    try:
        retain_freed_memory()
    except RuntimeError:
        return "not glibc"
    return "retain"
