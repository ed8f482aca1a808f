"""Score variants: what happens to the scores between ``q k^T * scale`` and the softmax.

Shape legend: B batch, h query heads, Tq query length, Tk key length, C a chunk of query rows.

A call's variants are a small immutable :class:`ScoreSpec`, beside :class:`mha.masks.MaskSpec`.
For query ``i``, key ``j``, batch ``b``, head ``hq``, in this order::

    s  = scale * (q_i . k_j)
    s  = softcap * tanh(s / softcap)              softcap (Gemma 2's order: after the scale)
    s  = s + bias[b, hq, i, j]                    bias, broadcastable to (B, h, Tq, Tk)
    s  = s - slope[b, hq] * (i + Tk - Tq - j)     alibi_slopes (h,) or (B, h)
    p_ij = exp(s_ij) / (sum_{j kept} exp(s_ij) + exp(sinks[hq]))     sinks (h,)

ALiBi is aligned to the bottom right like ``causal`` (the last query sits at key ``Tk - 1``)
and signed: keys after the diagonal get a bonus. Per query row it differs from BLOOM's
``slope * j`` by a constant, so the softmax equals BLOOM's under any mask — but not with a
sink, whose logit is not shifted.

A sink adds ``exp(sinks[hq])`` to the denominator only (it has no value): the weights of a
row sum to less than 1 and the returned weights exclude the sink; the log-sum-exp includes it.
A row with no kept key returns zeros, with or without a sink.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

#: The variant kinds, as named in capability tables and rejection reasons.
VARIANT_KINDS = frozenset({"softcap", "sinks", "bias", "alibi"})


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """The ALiBi slopes ``(n_heads,)`` float32 of Press et al. (2022): for ``n`` a power of two
    the geometric sequence ``2^(-8/n), 2^(-16/n), ..., 2^(-8)``; otherwise the ``p`` slopes of
    the largest power of two ``p < n`` followed by every other slope of ``2p``."""
    from mha.checks import check_int

    n = check_int("n_heads", n_heads, low=1, what="a positive int (the number of heads)")

    def geometric(m: int) -> list[float]:
        start = 2.0 ** (-8.0 / m)
        return [start ** (k + 1) for k in range(m)]

    p = 2 ** int(math.floor(math.log2(n)))
    slopes = geometric(p) + geometric(2 * p)[0::2][: n - p]
    return torch.tensor(slopes, dtype=torch.float32)  # (n_heads,)


def alibi_distance(Tq: int, Tk: int, *, rows: slice | None = None,
                   device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(C, Tk)``: ``i + Tk - Tq - j`` for query rows ``i`` in ``rows`` (all Tq by default) —
    how far key ``j`` lies before query ``i``'s bottom-right diagonal (negative after it)."""
    if rows is None:  # all rows: no Python range, so a symbolic Tq stays symbolic (export)
        i = torch.arange(Tq, device=device, dtype=dtype).unsqueeze(1)  # (Tq, 1)
    else:
        r = range(Tq)[rows]
        i = torch.arange(r.start, r.stop, device=device, dtype=dtype).unsqueeze(1)  # (C, 1)
    j = torch.arange(Tk, device=device, dtype=dtype).unsqueeze(0)  # (1, Tk)
    return i + (Tk - Tq) - j  # (C, Tk)


@dataclass(frozen=True)
class ScoreSpec:
    """The score variants of one attention call (see the module docstring). Immutable."""

    softcap: float | None = None
    sinks: torch.Tensor | None = None  # (h,) float
    bias: torch.Tensor | None = None  # float, 4-D view broadcastable to (B, h, Tq, Tk)
    alibi_slopes: torch.Tensor | None = None  # (1|B, h) float
    #: The kinds present, a subset of :data:`VARIANT_KINDS`.
    kinds: frozenset[str] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        kinds = frozenset((("softcap",) if self.softcap is not None else ())
                          + (("sinks",) if self.sinks is not None else ())
                          + (("bias",) if self.bias is not None else ())
                          + (("alibi",) if self.alibi_slopes is not None else ()))
        object.__setattr__(self, "kinds", kinds)

    @property
    def is_empty(self) -> bool:
        return not self.kinds

    def grad_tensors(self) -> tuple[torch.Tensor, ...]:
        """The variant tensors autograd may differentiate (sinks, bias, ALiBi slopes)."""
        return tuple(t for t in (self.sinks, self.bias, self.alibi_slopes) if t is not None)

    def modify(self, s: torch.Tensor, Tq: int, rows: slice | None = None) -> torch.Tensor:
        """Softcap, bias and ALiBi applied to scaled scores ``s`` ``(B|1, h, C, Tk)`` of the
        query rows ``rows`` (all ``Tq`` rows by default). The bias is added through its
        broadcast view (never expanded)."""
        Tk = s.shape[-1]
        if self.softcap is not None:
            s = self.softcap * torch.tanh(s / self.softcap)
        if self.bias is not None:
            b = self.bias if self.bias.shape[2] == 1 or rows is None else self.bias[:, :, rows]
            s = s + b.to(s.dtype)  # (B|1, h|1, C|1, Tk|1) broadcast
        if self.alibi_slopes is not None:  # the distance in at least float32: exact to 2^24
            wide = torch.promote_types(s.dtype, torch.float32)
            dist = alibi_distance(Tq, Tk, rows=rows, device=s.device, dtype=wide)  # (C, Tk)
            slopes = self.alibi_slopes.to(wide)[:, :, None, None]  # (1|B, h) -> (1|B, h, 1, 1)
            s = s - (slopes * dist).to(s.dtype)  # (1|B, h, C, Tk)
        return s

    def softmax(self, s: torch.Tensor) -> torch.Tensor:
        """``softmax(s)`` over the last dim, with the sink's ``exp(sinks[hq])`` in each
        denominator. ``s`` ``(B, h, C, Tk)``; returns the weights ``(B, h, C, Tk)`` (sink
        excluded)."""
        if self.sinks is None:
            return torch.softmax(s, dim=-1)
        B, h, C, _ = s.shape
        sink = self.sinks.to(s.dtype).view(1, h, 1, 1).expand(B, h, C, 1)  # (B, h, C, 1)
        both = torch.cat([s, sink], dim=-1)  # (B, h, C, Tk + 1)
        return torch.softmax(both, dim=-1)[..., :-1]  # (B, h, C, Tk), the sink dropped


    def logsumexp(self, s: torch.Tensor) -> torch.Tensor:
        """``log(sum_j exp(s_ij) + exp(sinks[hq]))`` over the last dim: the log of the softmax
        denominator, sink included. ``s`` ``(B, h, C, Tk)`` with masked pairs at ``-inf``;
        returns ``(B, h, C)`` (``-inf`` for a row with no visible key and no sink)."""
        lse = torch.logsumexp(s, dim=-1)  # (B, h, C)
        if self.sinks is None:
            return lse
        return torch.logaddexp(lse, self.sinks.to(s.dtype).view(1, -1, 1))  # (B, h, C)


NO_SCORES = ScoreSpec()  #: the call without variants (immutable, shared)
