"""Attention with ``mask_mod`` / ``score_mod`` in PyTorch ops: a walk over a block plan (the fast
path until a native kernel walks plans), and the plain dense formula beside it.

Shape legend: B batch, h query heads, h_kv K/V heads, g = h // h_kv, Tq/Tk lengths, d_k/d_v
head dims; for one step of the walk, ``rows`` query indices and ``n`` gathered key indices.

:func:`block_sparse_attention` visits, for each query block, only the key blocks the plan marks
FULL or PARTIAL: it gathers their K/V rows, computes the scores ``(., ., rows, n)``, applies
``score_mod``, evaluates ``mask_mod`` over the partial blocks only, and softmaxes with the usual
rule (a row with no key returns zeros, with finite gradients). Its cost follows the visited
blocks: for a document mask, ``sum(len_i^2)`` rather than ``T^2``. Everything is autograd-able.
"""

from __future__ import annotations

import torch

from mha.blockplan import BlockPlan
from mha.masks import open_empty_rows
from mha.mods import apply_score_mod


def _softmax_v(scores: torch.Tensor, allowed: torch.Tensor | None, vg: torch.Tensor,
               g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(scores) v`` over the allowed pairs; rows with none give zeros.
    scores ``(b, hq, rows, n)``, vg ``(b, hk, n, d_v)`` with ``hq = g * hk``."""
    row_has_key = None
    if allowed is not None:
        allowed, row_has_key = open_empty_rows(allowed.expand_as(scores))
        scores = scores.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(scores, dim=-1)  # (b, hq, rows, n)
    if row_has_key is not None:
        w = torch.where(row_has_key, w, 0.0)  # rows with no key: zero weights
    b, hq, rows, n = w.shape
    wg = w.reshape(b, hq // g, g * rows, n)  # (b, hq, rows, n) -> (b, hk, g*rows, n)
    out = (wg @ vg).view(b, hq, rows, vg.shape[-1])  # (b, hk, g*rows, d_v) -> (b, hq, rows, d_v)
    return out, w


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    allowed: torch.Tensor | None, scale: float, score_mod=None,
                    dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain formula with a ``score_mod``: ``softmax(mask(score_mod(q k^T * scale))) v``.
    q ``(B, h, Tq, d_k)``, k/v ``(B, h_kv, Tk, d)``, allowed broadcastable to ``(B, h, Tq, Tk)``.
    Returns ``(out (B, h, Tq, d_v), weights (B, h, Tq, Tk))``."""
    B, h, Tq, d_k = q.shape
    h_kv, Tk = k.shape[1], k.shape[2]
    g = h // h_kv
    qg = q.reshape(B, h_kv, g * Tq, d_k)  # (B, h, Tq, d_k) -> (B, h_kv, g*Tq, d_k)
    s = (qg @ k.transpose(-2, -1) * scale).view(B, h, Tq, Tk)  # (B, h_kv, g*Tq, Tk) -> (B, h, Tq, Tk)
    dev = q.device
    if score_mod is not None:
        s = apply_score_mod(score_mod, s, torch.arange(B, device=dev), torch.arange(h, device=dev),
                            torch.arange(Tq, device=dev), torch.arange(Tk, device=dev),
                            "the whole (Tq, Tk) score matrix")
    if dropout_p == 0.0:
        return _softmax_v(s, allowed, v, g)
    _, w = _softmax_v(s, allowed, v[..., :0], g)
    used = torch.nn.functional.dropout(w, dropout_p).reshape(B, h_kv, g * Tq, Tk)
    return (used @ v).view(B, h, Tq, v.shape[-1]), w  # (B, h_kv, g*Tq, d_v) -> (B, h, Tq, d_v)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, *,
                           scale: float, score_mod=None,
                           mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the plan's FULL and PARTIAL blocks only. q ``(B, h, Tq, d_k)``, k/v
    ``(B, h_kv, Tk, d)``; ``mask`` an extra bool tensor, a 4-D view broadcastable to
    ``(B, h, Tq, Tk)``, ANDed per block. Returns ``out (B, h, Tq, d_v)``."""
    B, h, Tq, d_k = q.shape
    h_kv, d_v = k.shape[1], v.shape[3]
    g = h // h_kv
    out = q.new_zeros(B, h, Tq, d_v)  # rows of query blocks with no key block stay zero
    dev = q.device
    all_b, all_h = torch.arange(B, device=dev), torch.arange(h, device=dev)
    for b, hh, qb, cols, n_full, pcols in plan.walk():
        bs = slice(None) if plan.B == 1 else slice(b, b + 1)
        hs = slice(None) if plan.h == 1 else slice(hh, hh + 1)  # query heads of this step
        ks = slice(None) if plan.h == 1 else slice(hh // g, hh // g + 1)  # their K/V head
        gg = g if plan.h == 1 else 1
        r0, r1 = qb * plan.block_q, min(Tq, (qb + 1) * plan.block_q)
        cols = cols.to(dev)
        qs = q[bs, hs, r0:r1]  # (b, hq, rows, d_k)
        kc = k[bs, ks].index_select(2, cols)  # (b, hk, n, d_k)
        vc = v[bs, ks].index_select(2, cols)  # (b, hk, n, d_v)
        nb, hq, rows = qs.shape[0], qs.shape[1], r1 - r0
        qg = qs.reshape(nb, hq // gg, gg * rows, d_k)  # (b, hq, rows, d_k) -> (b, hk, g*rows, d_k)
        s = (qg @ kc.transpose(-2, -1) * scale).view(nb, hq, rows, cols.numel())  # (b, hq, rows, n)
        if score_mod is not None:
            s = apply_score_mod(score_mod, s, all_b[bs], all_h[hs],
                                torch.arange(r0, r1, device=dev), cols,
                                f"query block {qb}, key blocks of the plan")
        allowed = None
        if pcols.numel():
            pm = plan.eval_partial(b, hh, qb, pcols.to(dev))  # (1|b, 1|hq, rows|1, np|1)
            lead = (pm.shape[0], pm.shape[1], rows)
            allowed = torch.cat([torch.ones(*lead, n_full, dtype=torch.bool, device=dev),
                                 pm.expand(*lead, pcols.numel())], dim=-1)  # (., ., rows, n)
        if mask is not None:
            m = mask[bs if mask.shape[0] > 1 else slice(None), hs if mask.shape[1] > 1 else
                     slice(None)]
            m = m[:, :, r0:r1] if m.shape[2] > 1 else m
            m = m.index_select(3, cols) if m.shape[3] > 1 else m  # (., ., rows|1, n|1)
            allowed = m if allowed is None else allowed & m
        o, _ = _softmax_v(s, allowed, vc, gg)  # (b, hq, rows, d_v)
        out[bs, hs, r0:r1] = o
    return out
