"""The host allocator for training on a CPU device (train.host_allocator).

glibc's malloc hands every large block (over its mmap threshold, at most 32 MiB) to the kernel with mmap and gives
it back with munmap when freed, and trims the top of its heap whenever enough of it is free. A training step frees
and allocates the same activations, gradients and temporaries every step, so each step faults the same pages in
again, a cost that is a large share of a small model's step on a CPU (bench/RESULTS.md, "Figures behind the code's
design choices", has the page faults and step times). PyTorch's CPU tuning guides swap in jemalloc or tcmalloc
for this (LD_PRELOAD, at process start); the same effect from inside the process is two mallopt settings: no mmap
for large blocks (they come from the heap and freed blocks are reused) and no trimming of the heap's top; and a
third, one arena for all threads, so that what one thread frees the others reuse. The Trainer sets them after the
model is loaded: the load streams each source tensor once, so there is nothing to reuse, and a heap that keeps those
blocks fragments, which raises the load's peak resident size above glibc's defaults when set before it.

The cost: memory freed during training stays with the process (its peak resident size is unchanged; it is reused by
the next step instead of being returned and faulted in again). Other allocators (musl, macOS, Windows) are left as
they are: there is nothing to set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1


@functools.lru_cache(maxsize=1)
def glibc():
    """glibc's handle, or None on another C library / platform."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep and reuse freed memory (no mmap for large blocks, no heap trimming) for the rest of
    the process. Returns whether it applies here (glibc accepted both settings)."""
    libc = glibc()
    if libc is None:
        return False
    no_mmap = libc.mallopt(ctypes.c_int(M_MMAP_MAX), ctypes.c_int(0))
    no_trim = libc.mallopt(ctypes.c_int(M_TRIM_THRESHOLD), ctypes.c_int(_INT_MAX))
    # One arena for every thread: glibc gives a thread that allocates its own arena, which would now keep what that
    # thread frees apart from the main one, and the step's peak resident size would grow rather than stay level.
    libc.mallopt(ctypes.c_int(M_ARENA_MAX), ctypes.c_int(1))
    return bool(no_mmap and no_trim)


def apply_host_allocator(kind: str, device_type: str, fsdp_sharded: bool) -> bool:
    """train.host_allocator: `reuse` keeps freed memory when the model trains on the CPU (where every step's
    tensors live in host memory); `system`, GPU training and ZeRO-2/3 leave malloc as it is -- FSDP2's gathers
    give each freed unit back to the system before the next (fitlm.parallel.data_parallel) to hold a rank's host
    peak near its shard, which large blocks kept in the heap would undo. Returns whether it was set."""
    return kind == "reuse" and device_type == "cpu" and not fsdp_sharded and keep_freed_memory()
