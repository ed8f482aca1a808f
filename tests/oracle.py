"""The tolerance rule used across the tests (flash-attention's rule, stated once).

An implementation's error against the float64 per-head loop must be at most twice the error of
the naive computation done in the same low precision (the reference loop without upcast), plus
a small absolute floor for values that round exactly in both.
"""

from __future__ import annotations

import torch

from mha import reference

FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}


def oracle(q, k, v, allowed=None, scale=None):
    """``(out, weights)`` in float64 from the seed-000 loop."""
    return reference.attention(q, k, v, allowed=allowed, scale=scale, upcast=True)


def naive(q, k, v, allowed=None, scale=None):
    """The same loop in the inputs' own precision: the error budget's yardstick."""
    return reference.attention(q, k, v, allowed=allowed, scale=scale, upcast=False)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def assert_within_budget(got: torch.Tensor, q, k, v, allowed=None, scale=None, *,
                         index: int = 0, what: str = "output") -> None:
    """``got`` is within 2x the naive low-precision error of the fp64 oracle.

    ``index`` picks the output (0) or the weights (1) of the oracle.
    """
    ref = oracle(q, k, v, allowed, scale)[index]
    low = naive(q, k, v, allowed, scale)[index]
    budget = 2 * max_err(low, ref) + FLOOR[q.dtype]
    err = max_err(got, ref)
    assert err <= budget, f"{what}: error {err:.3e} > budget {budget:.3e} (2x naive + floor)"
