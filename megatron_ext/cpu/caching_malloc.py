"""glibc malloc turned into a caching allocator: no page fault for a tensor that reuses freed memory.

A fresh CPU tensor beyond glibc's mmap threshold is its own mmap, so every page of it faults in on
first touch, every time; a GPU caching allocator reuses its freed blocks and never pays that. The
threshold also moves with what the process freed before, so two variants of the same size can
fault differently. :func:`keep_freed_memory` makes malloc keep freed memory instead (no mmap'd
chunks, no trimming of the heap), so a freed tensor's pages are reused. Minor faults per
``x = torch.ones(16 * 2**20); del x`` (64 MiB, 4 KiB pages)::

    glibc's defaults                          16384   (every page, every time)
    after keep_freed_memory(), warmed up          0   (the heap's pages reused)

Warming up takes several allocations: torch's 64-byte-aligned blocks leave small live blocks
between freed ones, so the heap first grows by a few 64 MiB chunks (7 to 9 faulting allocations,
~450 MiB more resident memory: the example above repeated 15 times, glibc 2.36, torch 2.13) and
then reuses them (``tests/bench/test_allocator_pair.py`` times 16 per step for that reason); a
training step's fixed set of sizes warms up the same way.

The setting cannot be undone in a process: the benchmarks apply it in worker processes of their
own (the ``caching`` rows) and shut them down after. Every ``--cpu`` launch applies it at startup
(``--no-cpu-caching-malloc`` turns it off); a GPU launch never does (its tensors live in PyTorch's CUDA
caching allocator, which reuses its blocks already).
"""

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> None:
    """glibc malloc as a caching allocator for the rest of this process (irreversible).

    No allocation is served by its own mmap (``M_MMAP_MAX`` 0) and the heap top is never given
    back (``M_TRIM_THRESHOLD`` at its maximum), so freed tensors' pages are reused.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallopt"):
        raise RuntimeError("the 'caching' allocator setting needs glibc's mallopt")
    ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not ok:
        raise RuntimeError("glibc's mallopt refused the 'caching' allocator setting")
