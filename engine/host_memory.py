"""How the process gets memory from Linux: huge pages for the KV pool, and a heap that keeps
what it frees.

Huge pages. Decode attention reads the KV pool in blocks of a few KiB scattered over
gigabytes, so with 4 KiB pages nearly every block costs a TLB miss and a page walk; on huge
pages the same reads measured 7-9% faster (the native kernel and a plain read alike). Many
kernels run THP in ``madvise`` mode, where only memory marked ``MADV_HUGEPAGE`` gets huge
pages. Advice is best effort: elsewhere, or when the kernel refuses, nothing changes but the
speed.

A heap that keeps what it frees. Every step allocates its activations afresh, up to ~13 MB
each for a 2,048-token chunk. glibc serves blocks that large with ``mmap`` and returns them
with ``munmap``, so every step faults its activations in again, 4 KiB at a time: 2.6 million
page faults in a 45 s fp32 prefill-heavy run, which fell to 30 thousand with the heap kept,
and the run took 5% less time (2026-11-23). Same advice: glibc only, best effort.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

MADV_HUGEPAGE = 14  # <linux/mman.h>
HUGE_PAGE_BYTES = 2 * 1024 * 1024
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's ceiling for it on 64-bit
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024  # free heap kept before any goes back to the OS


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Mark the whole 2 MiB pages inside ``tensor``'s storage for huge pages.

    Call it before the memory is first written (e.g. on ``torch.empty``): pages already
    faulted in stay small. Returns True when the advice was taken.
    """
    libc = _libc()
    if libc is None or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES  # round up: whole pages only
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return False
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True


def on_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the CPU ``tensors`` side by side (64-byte aligned) in one fresh buffer
    advised onto huge pages before it is written: for weights that every step reads front to
    back, too many and too small each for a 2 MiB page of their own. The originals are left
    to the caller to drop (see :func:`release_free_heap`)."""
    starts, end = [], 0
    for tensor in tensors:
        starts.append(end)
        end += -(-tensor.numel() * tensor.element_size() // 64) * 64
    buffer = torch.empty(end, dtype=torch.uint8)
    advise_huge_pages(buffer)
    copies = []
    for tensor, start in zip(tensors, starts, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        copy = buffer[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
        copies.append(copy.copy_(tensor))
    return copies


def release_free_heap() -> bool:
    """Give the heap's free pages back to the OS now (glibc's ``malloc_trim``), e.g. after
    replacing hundreds of megabytes of weights: the heap that keeps freed memory would keep
    those too. True when glibc released some."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    return bool(libc.malloc_trim(0))


@functools.cache
def keep_freed_memory() -> bool:
    """Serve allocations up to 32 MiB from the heap and keep up to 1 GiB of it free, so the
    activations of one step reuse the pages of the last. Once per process; True when glibc
    took both settings. Process-wide: meant for serving processes, where the CPU model runner
    calls it; a program that embeds the engine gets the same settings."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    taken = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    taken &= libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    log.debug("heap keeps freed memory: %s", taken)
    return taken


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library on Linux, with ``madvise`` typed, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError as err:
        log.debug("no libc to call madvise and mallopt through: %s", err)
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    if hasattr(libc, "mallopt"):  # glibc's; musl has none
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    if hasattr(libc, "malloc_trim"):  # glibc's too
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    return libc
