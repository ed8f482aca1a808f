"""Large CPU buffers on transparent huge pages (2 MiB), for storage that is read as a stream.

A decoding step reads the whole K/V cache once. On 4 KiB pages the hardware prefetchers stop
at every page boundary and every 4 KiB costs a TLB entry; on 2 MiB pages the same read runs
faster (a one-thread AVX-512 read of 67-268 MB of K/V on epyc-zen4-avx512 took 0.58-0.78x
the time: ``benchmarks/probes/decode_ab.py --pages 4k 2m``, docs/decoding.md). ``torch.empty``
maps large blocks with glibc's ``mmap`` in 4 KiB pages unless the process runs with
``THP_MEM_ALLOC_ENABLE=1``; numpy advises its own large arrays, which is why a peer reading a
numpy copy of the cache has the advantage unless the cache does the same.

:func:`empty` advises ``madvise(MADV_HUGEPAGE)`` on the whole 2 MiB pages inside a fresh
block before anything touches it, so the first writes fault in huge pages where the kernel's
transparent huge pages are in ``madvise`` or ``always`` mode. It is a hint: elsewhere (THP
off, not Linux, not the CPU device, small blocks) the tensor is a plain ``torch.empty``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

HUGE_PAGE = 2 << 20  # bytes: x86-64's (and most aarch64 kernels') transparent huge page
MIN_BYTES = 4 * HUGE_PAGE  # smaller blocks: too few whole huge pages inside to matter
_MADV_HUGEPAGE = 14  # linux/mman.h


@functools.cache
def _madvise():
    """libc's ``madvise``, or None where there is none to call (not Linux, no libc found)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def advise(t: torch.Tensor) -> int:
    """Ask for huge pages on the whole 2 MiB pages inside ``t``'s bytes (call it before the
    first write). Returns the number of bytes advised (0: nothing was, or the call failed)."""
    fn = _madvise()
    if fn is None or t.device.type != "cpu" or t.nbytes < MIN_BYTES:
        return 0
    p = t.data_ptr()
    a = (p + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)  # the first whole huge page
    e = (p + t.nbytes) & ~(HUGE_PAGE - 1)  # the end of the last whole one
    if e <= a or fn(a, e - a, _MADV_HUGEPAGE) != 0:
        return 0
    return e - a


def empty(*shape: int, dtype: torch.dtype, device: torch.device | str | None = None,
          ) -> torch.Tensor:
    """``torch.empty(shape)`` whose bytes are advised to huge pages (on the CPU, when large)."""
    t = torch.empty(shape, dtype=dtype, device=device)  # (*shape)
    advise(t)
    return t


def zeros(*shape: int, dtype: torch.dtype, device: torch.device | str | None = None,
          ) -> torch.Tensor:
    """:func:`empty`, then zeroed (the first write: it faults the advised pages in)."""
    return empty(*shape, dtype=dtype, device=device).zero_()  # (*shape)


__all__ = ["HUGE_PAGE", "MIN_BYTES", "advise", "empty", "zeros"]
