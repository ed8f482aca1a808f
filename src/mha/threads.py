"""torch's intra-op thread count for the length of a block: :func:`num_threads`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from mha.checks import check_int


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """torch on ``n`` threads (a positive int; numpy ints accepted) inside the block; the count
    before it is restored after it, also when the block raises. Blocks nest. A bad ``n`` is
    refused (TypeError / ValueError naming it) before the count changes."""
    n = check_int("n", n, low=1, what="a positive int (torch's intra-op thread count)")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
