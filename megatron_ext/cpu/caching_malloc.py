"""glibc malloc turned into a caching allocator: no page fault for a tensor that reuses freed memory.

A fresh CPU tensor beyond glibc's mmap threshold is its own mmap, so every page of it faults in on
every allocation; a GPU caching allocator reuses its blocks and never pays that. Minor faults per
``x = torch.ones(16 * 2**20); del x`` (64 MiB, 4 KiB pages)::

    glibc's defaults                          16384   (every page, every time)
    after keep_freed_memory(), warmed up          0   (the heap's pages reused)

Every ``--cpu`` launch applies it (docs/rehearse.md); a GPU launch never does.
"""

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> None:
    """glibc malloc as a caching allocator for the rest of this process (irreversible)."""
    # Irreversible, so the benchmarks' ``caching`` rows apply it in worker processes of their own.
    # Warming up takes several allocations: torch's 64-byte-aligned blocks leave small live blocks
    # between freed ones, so the heap first grows by a few 64 MiB chunks (7 to 9 faulting
    # allocations, ~450 MiB more resident: the docstring's example 15 times, glibc 2.36, torch 2.13)
    # and then reuses them; tests/bench/test_allocator_pair.py times 16 per step for that reason.
    # The default mmap threshold also moves with what the process freed before, so two variants of
    # one size can fault differently under glibc's defaults.
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallopt"):
        raise RuntimeError("the 'caching' allocator setting needs glibc's mallopt")
    # No allocation served by its own mmap (M_MMAP_MAX 0), the heap top never given back
    # (M_TRIM_THRESHOLD at its maximum): freed tensors' pages are reused.
    ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not ok:
        raise RuntimeError("glibc's mallopt refused the 'caching' allocator setting")
