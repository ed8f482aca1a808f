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


# A mask_mod reading a tensor that the caller changes between calls (document ids of the
# current batch, a padding table): the FlexAttention habit. Module-level, as a script has it.
ALLOWED = torch.ones(300, dtype=torch.bool)  # (Tk,)


def _reads_a_global(b, h, q_idx, kv_idx):
    return ALLOWED[kv_idx] & (kv_idx <= q_idx + 100)


def _truth(allowed: torch.Tensor, Tq: int, Tk: int) -> torch.Tensor:
    near = torch.arange(Tk)[None, :] <= torch.arange(Tq)[:, None] + 100  # (Tq, Tk)
    return (allowed[None, :] & near)[None, None]  # (1, 1, Tq, Tk)


@pytest.mark.parametrize("backend", [None, "flash_cpu", "blocksparse", "reference"])
@pytest.mark.parametrize("how", ["global in place", "closure in place", "closure rebound"])
def test_a_mask_mod_whose_data_changed_is_planned_anew(backend, how):
    """The second call, after the data the function reads changed, gives the answer of the
    changed mask: the plan cached for the function (keyed by its identity) was reused, and the
    answer was the first call's (flash_cpu), or a mix of both masks (reference, blocksparse)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 200, 16), torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    table = torch.ones(300, dtype=torch.bool)
    ALLOWED.fill_(True)

    def reads_a_closure(b, h, q_idx, kv_idx):
        return table[kv_idx] & (kv_idx <= q_idx + 100)

    fn = _reads_a_global if how.startswith("global") else reads_a_closure
    mha.attention(q, k, v, mask_mod=fn, backend=backend)
    if how == "global in place":
        ALLOWED[:150] = False
        now = ALLOWED
    elif how == "closure in place":
        table[:150] = False
        now = table
    else:
        table = torch.arange(300) % 3 != 0  # noqa: F841 -- read by reads_a_closure
        now = table
    got = mha.attention(q, k, v, mask_mod=fn, backend=backend)
    want = mha.attention(q, k, v, mask=_truth(now, 200, 300), backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_mask_mod_whose_data_did_not_change_keeps_its_plan():
    table = torch.arange(300) % 2 == 0  # (Tk,)

    def fn(b, h, q_idx, kv_idx):
        return table[kv_idx] & (kv_idx <= q_idx)

    first = block_plan(fn, 1, 2, 200, 300)
    assert block_plan(fn, 1, 2, 200, 300) is first
    table[0] = False
    assert block_plan(fn, 1, 2, 200, 300) is not first


class _Documents:
    """A batch's document ids held by an object, read by a bound method."""

    def __init__(self, Tk: int):
        self.ids = torch.zeros(Tk, dtype=torch.int64)  # (Tk,)

    def mask_mod(self, b, h, q_idx, kv_idx):
        return self.ids[q_idx + 100] == self.ids[kv_idx]


def test_a_bound_methods_data_is_followed():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 200, 16), torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    docs = _Documents(300)
    mha.attention(q, k, v, mask_mod=docs.mask_mod)
    docs.ids = torch.arange(300) // 70  # the next batch's documents
    got = mha.attention(q, k, v, mask_mod=docs.mask_mod)
    same = docs.ids[torch.arange(200)[:, None] + 100] == docs.ids[None, :]  # (Tq, Tk)
    want = mha.attention(q, k, v, mask=same[None, None], backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["nope", 3.5] + ([] if torch.cuda.is_available() else ["cuda"]))
def test_a_device_block_plan_cannot_use_is_named(device):
    with pytest.raises(ValueError, match="device: .* is not a device this torch can use"):
        block_plan(mods.causal(), 1, 1, 10, 10, device=device, cache=False)


@pytest.mark.parametrize("convert, words", [
    (lambda r: r.to("meta"), "on meta, not on cpu"),
    (lambda r: r.expand(1, 1, -1, -1).to_sparse(), "dense"),
])
def test_a_mask_mod_result_elsewhere_or_sparse_is_named(convert, words):
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ModError, match=f"mask_mod.*{words}"):
        mha.attention(q, q, q, mask_mod=lambda b, h, i, j: convert(j <= i))


class _CountingList(list):
    """A list that counts the items read from it (how much a fingerprint looks at)."""

    read = 0

    def __iter__(self):
        for item in super().__iter__():
            _CountingList.read += 1
            yield item


# A module-level table of Python numbers that a mask_mod's code names (never a tensor).
TABLE = _CountingList(_CountingList(range(256)) for _ in range(256))


def _names_a_table(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) if TABLE else kv_idx < 0


def test_what_a_fingerprint_looks_at_is_bounded_in_all():
    """Each call with a cached plan fingerprints what the mask_mod reads: the first items of
    each container, and a bounded number in all, not a 256 x 256 table of ints that its code
    names whole (65,792 items, ~11 ms of every call)."""
    from mha import blockplan

    first = block_plan(_names_a_table, 1, 1, 16, 16)
    _CountingList.read = 0
    assert block_plan(_names_a_table, 1, 1, 16, 16) is first
    assert 0 < _CountingList.read <= blockplan._READ_BUDGET


def test_a_tensor_rebound_twice_is_not_taken_for_the_first():
    """A closure's tensor rebound twice between calls: the third tensor may take the first's
    Python object address and storage (both freed), so identity, storage and version alone
    match the plan of the first mask; the plan must still be rebuilt. Repeated, as whether
    the addresses are reused is up to the allocators."""
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 200, 16), torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    for _ in range(40):
        table = torch.ones(300, dtype=torch.bool)  # (Tk,)

        def fn(b, h, q_idx, kv_idx):
            return table[kv_idx] & (kv_idx <= q_idx + 100)  # noqa: B023 -- the rebound one

        mha.attention(q, k, v, mask_mod=fn)
        table = torch.arange(300) % 2 == 0
        table = torch.arange(300) % 3 != 0
        got = mha.attention(q, k, v, mask_mod=fn)
        want = mha.attention(q, k, v, mask=_truth(table, 200, 300), backend="reference")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
