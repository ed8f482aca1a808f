"""Running a test's computation at a given torch thread count (the kernels promise results that
do not depend on it)."""

from __future__ import annotations

import torch


def with_threads(n: int, fn):
    """``fn()`` run with ``torch.set_num_threads(n)``; the previous count is restored."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(threads)
