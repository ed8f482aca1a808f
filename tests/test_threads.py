"""mha.threads.num_threads: torch's thread count inside the block, the caller's after it
(also when the block raises)."""

from __future__ import annotations

import pytest
import torch

from mha.threads import num_threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_count_inside_and_after(two_threads):
    with num_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_the_count_is_restored_when_the_block_raises(two_threads):
    with pytest.raises(KeyError), num_threads(1):
        raise KeyError("inside")
    assert torch.get_num_threads() == 2
