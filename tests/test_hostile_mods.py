"""``mha.block_plan`` and ``mask_mod`` / ``score_mod`` as a careless user calls them: block sizes
that are not positive ints, or so large that one block's mask could not be held, are refused
naming the argument before anything is evaluated or allocated; a mask_mod of the wrong kind
is a ModError naming the function and the block.

Shape legend: B batch, h heads, Tq / Tk lengths, d head dim.
"""

from __future__ import annotations

import pytest
import torch

import mha
from mha import mods
from mha.blockplan import block_plan
from mha.mods import ModError


def _never_called(b, h, q_idx, kv_idx):
    raise AssertionError("the mask was evaluated")


@pytest.mark.parametrize("block_q, block_k, name", [
    (1 << 20, 1 << 20, "block_q"), (1 << 40, 1 << 40, "block_q"), (10 ** 30, 1, "block_q"),
    (1, 1 << 25, "block_k"),
])
def test_a_block_too_large_to_hold_is_refused_before_evaluating(block_q, block_k, name):
    """A partial block's mask is kept as block_q x block_k bytes: a block of 2^40 pairs was
    allocated (and failed) or overflowed inside torch, whatever Tq and Tk."""
    with pytest.raises(ValueError, match=rf"{name}.*block_q \* block_k"):
        block_plan(_never_called, 1, 1, 100, 100, block_q=block_q, block_k=block_k, cache=False)


@pytest.mark.parametrize("block_q, block_k, exc", [
    (0, 128, ValueError), (-1, 128, ValueError), (128, 0, ValueError), (True, 128, TypeError),
    (128, 2.0, TypeError), (None, 128, TypeError)])
def test_block_sizes_that_are_not_positive_ints_are_named(block_q, block_k, exc):
    name = "block_q" if block_k == 128 else "block_k"
    with pytest.raises(exc, match=name):
        block_plan(_never_called, 1, 1, 100, 100, block_q=block_q, block_k=block_k, cache=False)


def test_a_block_larger_than_the_problem_is_one_block():
    """Blocks larger than Tq / Tk (within the bound) are fine: one block, the causal mask."""
    plan = block_plan(mods.causal(), 1, 1, 100, 100, block_q=4096, block_k=4096, cache=False)
    assert (plan.n_q, plan.n_k) == (1, 1)
    torch.testing.assert_close(plan.materialize()[0, 0],
                               torch.ones(100, 100, dtype=torch.bool).tril())


@pytest.mark.parametrize("mask_mod, words", [
    (lambda b, h, q, kv: (kv <= q).int(), "must return a bool tensor"),
    (lambda b, h, q, kv: True, "must return a bool tensor"),
    (lambda b, h, q, kv: torch.ones(3, 5, dtype=torch.bool), "not broadcastable"),
    (lambda b, h, q, kv: (kv <= q)[None], "not broadcastable"),
    (lambda b, h, q, kv: 1 / 0, "raised ZeroDivisionError"),
])
def test_a_mask_mod_of_the_wrong_kind_is_named(mask_mod, words):
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    with pytest.raises(ModError, match=words):
        mha.attention(q, k, v, mask_mod=mask_mod)
