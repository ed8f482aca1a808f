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
                         index: int = 0, what: str = "output", factor: float = 2.0) -> None:
    """``got`` is within ``factor`` (2) x the naive low-precision error of the fp64 oracle.

    ``index`` picks the output (0) or the weights (1) of the oracle.
    """
    ref = oracle(q, k, v, allowed, scale)[index]
    low = naive(q, k, v, allowed, scale)[index]
    budget = factor * max_err(low, ref) + FLOOR[q.dtype]
    err = max_err(got, ref)
    assert err <= budget, f"{what}: error {err:.3e} > budget {budget:.3e} ({factor:g}x naive + floor)"


def rule_oracle(q, k, v, allowed=None, scale=None):
    """The NaN/Inf rule of :mod:`mha.nonfinite`, in float64: row i is
    ``softmax(q_i K_J^T * scale) V_J`` over exactly the keys J it may attend — every (row, key)
    term of both sums is taken only where the pair is allowed, so no other key is touched —
    and zeros when J is empty or every score in it is -inf (an infinite key weighs 0, like an
    additive -inf mask). q ``(B, h, Tq, d_k)``, k/v ``(B, h_kv, Tk, d)``, allowed
    broadcastable to ``(B, h, Tq, Tk)``. Returns ``(B, h, Tq, d_v)`` float64."""
    B, h, Tq, d_k = q.shape
    Tk = k.shape[2]
    g = h // k.shape[1]
    scale = d_k ** -0.5 if scale is None else scale
    if allowed is None:
        allowed = torch.ones(1, 1, Tq, Tk, dtype=torch.bool)
    allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
    vis = allowed.expand(B, h, Tq, Tk)[..., None]  # (B, h, Tq, Tk, 1)
    kq = k.double().repeat_interleave(g, 1)[:, :, None]  # (B, h, 1, Tk, d_k)
    vq = v.double().repeat_interleave(g, 1)[:, :, None]  # (B, h, 1, Tk, d_v)
    terms = q.double()[:, :, :, None] * kq  # (B, h, Tq, Tk, d_k)
    s = torch.where(vis, terms, 0.0).sum(-1) * scale  # (B, h, Tq, Tk): allowed pairs only
    s = s.masked_fill(~vis[..., 0], float("-inf"))
    w = torch.softmax(s, dim=-1)  # (B, h, Tq, Tk); NaN for empty rows, removed below
    pv = torch.where(vis, w[..., None] * vq, 0.0).sum(-2)  # (B, h, Tq, d_v)
    has_key = (s != float("-inf")).any(-1, keepdim=True)  # (B, h, Tq, 1)
    return torch.where(has_key, pv, 0.0)  # rows with no allowed (or only -inf) key: zeros
