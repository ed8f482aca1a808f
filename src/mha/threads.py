"""torch's intra-op thread count for the length of a block: :func:`num_threads`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """torch on ``n`` threads inside the block; the count before it is restored after it, also
    when the block raises."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
