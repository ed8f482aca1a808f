"""Large CPU buffers advised to transparent huge pages (``mha.hugepages``), and the K/V caches
that allocate their storage with it.

Whether the kernel then backs them with 2 MiB pages depends on the OS (THP mode, free memory),
so the tests check the advice itself: the mapping that holds the buffer carries the ``hg`` flag
(``VM_HUGEPAGE``) in ``/proc/self/smaps``, which only ``madvise(MADV_HUGEPAGE)`` sets. The caches
hold 32 MiB blocks: glibc maps those fresh every time (its mmap threshold grows to 32 MiB at
most), so no mapping advised by an earlier test can hold them.
"""

from __future__ import annotations

import sys

import pytest
import torch

import mha
from mha import hugepages
from mha.paged import PagedKVCache

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"),
                           reason="MADV_HUGEPAGE and /proc/self/smaps are Linux's")


def _vm_flags(addr: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds ``addr``."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= addr < hi
            elif found and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def _advised(t: torch.Tensor) -> bool:
    """Whether the whole 2 MiB pages inside t's bytes are in a mapping advised to huge pages."""
    first = (t.data_ptr() + hugepages.HUGE_PAGE - 1) & ~(hugepages.HUGE_PAGE - 1)
    return "hg" in _vm_flags(first)


@LINUX
def test_advise_covers_the_whole_huge_pages_inside_the_buffer():
    t = torch.empty(5 * hugepages.HUGE_PAGE // 4)  # 10 MiB of fp32, not 2 MiB aligned
    got = hugepages.advise(t)
    p, e = t.data_ptr(), t.data_ptr() + t.nbytes
    want = (e & ~(hugepages.HUGE_PAGE - 1)) - ((p + hugepages.HUGE_PAGE - 1)
                                              & ~(hugepages.HUGE_PAGE - 1))
    assert got == want and got >= 4 * hugepages.HUGE_PAGE
    assert _advised(t)


@LINUX
def test_small_buffers_are_left_alone():
    t = torch.empty(hugepages.MIN_BYTES // 4 - 1)  # one float short of the threshold
    assert hugepages.advise(t) == 0


@LINUX
def test_empty_and_zeros_give_advised_tensors_of_the_shape_and_dtype():
    e = hugepages.empty(2, 3, 1 << 20, dtype=torch.bfloat16)  # 12 MiB
    z = hugepages.zeros(4, 1 << 20, dtype=torch.float32)  # 16 MiB
    assert e.shape == (2, 3, 1 << 20) and e.dtype == torch.bfloat16 and e.is_contiguous()
    assert z.shape == (4, 1 << 20) and z.dtype == torch.float32 and not z.any()
    assert _advised(e) and _advised(z)


@LINUX
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_kv_cache_storage_is_advised(kv_dtype):
    T_max = 8192 if kv_dtype is None else 32768  # 32 MiB of K (and of V) either way
    cache = mha.KVCache(1, 8, T_max, 128, dtype=torch.float32, kv_dtype=kv_dtype)
    assert _advised(cache.k) and _advised(cache.v)
    assert not cache.k.any() and not cache.v.any()  # zeroed, as before


@LINUX
def test_paged_pools_are_advised():
    cache = PagedKVCache(512, 16, 8, 128, max_seqs=2, max_len=1024, dtype=torch.float32)
    assert _advised(cache.k) and _advised(cache.v)
    assert not cache.k.any()


def test_no_advice_off_the_cpu_or_without_madvise(monkeypatch):
    t = torch.empty(hugepages.MIN_BYTES // 4 * 2)
    monkeypatch.setattr(hugepages, "_madvise", lambda: None)  # e.g. not Linux
    assert hugepages.advise(t) == 0
    assert hugepages.zeros(hugepages.MIN_BYTES // 4 * 2, dtype=torch.float32).shape == t.shape
    meta = torch.empty(hugepages.MIN_BYTES // 4 * 2, device="meta")
    monkeypatch.undo()
    assert hugepages.advise(meta) == 0
