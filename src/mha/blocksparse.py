"""Attention with ``mask_mod`` / ``score_mod`` in PyTorch ops: a walk over a block plan (the path
of a ``score_mod``, and of mask functions the native kernel cannot take: ``flash_cpu`` walks
plans natively), and the plain dense formula beside it.

Shape legend: B batch, h query heads, h_kv K/V heads, g = h // h_kv, Tq/Tk lengths, d_k/d_v
head dims; for one step of the walk, ``rows`` query indices and ``n`` gathered key indices.

:func:`block_sparse_attention` visits, for each query block, only the key blocks the plan marks
FULL or PARTIAL: it gathers their K/V rows, computes the scores, applies ``score_mod``, evaluates
``mask_mod`` over the partial blocks only, and softmaxes with the usual rule (a row with no key
returns zeros, with finite gradients). Query blocks with about as many key blocks are batched
into one step (padded to the same key count), so the Python loop runs a few times per plan row,
not once per block. Its cost follows the visited
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


def _grouped(x: torch.Tensor, hk: int, g: int, R: int, bq: int) -> torch.Tensor:
    """``(b, hq, R * bq, m)`` -> ``(b, hk, R, g * bq, m)``: a K/V head's query heads side by
    side in each query block (hq = hk * g)."""
    b, m = x.shape[0], x.shape[-1]
    x = x.reshape(b, hk, g, R, bq, m)  # (b, hq, R*bq, m) -> (b, hk, g, R, bq, m)
    return x.transpose(2, 3).reshape(b, hk, R, g * bq, m)  # -> (b, hk, R, g*bq, m)


def _ungrouped(x: torch.Tensor, g: int, bq: int) -> torch.Tensor:
    """The inverse of :func:`_grouped`: ``(b, hk, R, g * bq, m)`` -> ``(b, hq, R * bq, m)``."""
    b, hk, R, _, m = x.shape
    x = x.reshape(b, hk, R, g, bq, m).transpose(2, 3)  # -> (b, hk, g, R, bq, m)
    return x.reshape(b, hk * g, R * bq, m)  # -> (b, hq, R*bq, m)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, *,
                           scale: float, score_mod=None,
                           mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the plan's FULL and PARTIAL blocks only. q ``(B, h, Tq, d_k)``, k/v
    ``(B, h_kv, Tk, d)``; ``mask`` an extra bool tensor, a 4-D view broadcastable to
    ``(B, h, Tq, Tk)``, ANDed per block. Returns ``out (B, h, Tq, d_v)``.

    One batched step per group of query blocks (:meth:`BlockPlan.groups`): the group's ``R``
    query blocks, each with its own ``n`` gathered keys (padding masked out)."""
    B, h, Tq, d_k = q.shape
    h_kv, Tk, d_v = k.shape[1], k.shape[2], v.shape[3]
    g = h // h_kv
    bq = plan.block_q
    out = q.new_zeros(B, h, Tq, d_v)  # query blocks with no key block stay zero
    dev = q.device
    all_b, all_h = torch.arange(B, device=dev), torch.arange(h, device=dev)
    for grp in plan.groups():
        bs = slice(None) if plan.B == 1 else slice(grp.b, grp.b + 1)
        hs = slice(None) if plan.h == 1 else slice(grp.hh, grp.hh + 1)  # this step's query heads
        ks = slice(None) if plan.h == 1 else slice(grp.hh // g, grp.hh // g + 1)  # their K/V head
        gg = g if plan.h == 1 else 1
        R, n = grp.cols.shape
        raw = grp.qbs[:, None] * bq + torch.arange(bq, device=dev)  # (R, bq) query indices
        qrows = raw.clamp(max=Tq - 1)  # a short last block repeats its last row
        kv = grp.cols.repeat_interleave(bq, 0)  # (R*bq, n): each query row's keys
        qs = q[bs, hs].index_select(2, qrows.flatten())  # (b, hq, R*bq, d_k)
        hq = qs.shape[1]
        hk = hq // gg
        kc = k[bs, ks].index_select(2, grp.cols.flatten()).unflatten(2, (R, n))  # (b, hk, R, n, d_k)
        vc = v[bs, ks].index_select(2, grp.cols.flatten()).unflatten(2, (R, n))  # (b, hk, R, n, d_v)
        s = _grouped(qs, hk, gg, R, bq) @ kc.transpose(-2, -1) * scale  # (b, hk, R, g*bq, n)
        s = _ungrouped(s, gg, bq)  # (b, hq, R*bq, n)
        if score_mod is not None:
            s = apply_score_mod(score_mod, s, all_b[bs], all_h[hs], qrows.flatten(), kv,
                                f"query blocks {grp.qbs.tolist()}, their key blocks")
        allowed = grp.ok.repeat_interleave(bq, 0)[None, None]  # (1, 1, R*bq, n)
        if grp.n_partial:
            sel, pm = plan.eval_group(grp, qrows)  # (R',), (., ., R'*bq, P)
            lead = torch.broadcast_shapes(allowed.shape[:2], pm.shape[:2])
            allowed = allowed.expand(*lead, R * bq, n).clone().view(*lead, R, bq, n)
            P = grp.n_partial
            allowed[:, :, sel, :, :P] &= pm.expand(*lead, -1, -1).reshape(*lead, -1, bq, P)
            allowed = allowed.view(*lead, R * bq, n)  # (., ., R*bq, n)
        if mask is not None:
            m = mask[bs if mask.shape[0] > 1 else slice(None),
                     hs if mask.shape[1] > 1 else slice(None)]
            m = m.index_select(2, qrows.flatten()) if m.shape[2] > 1 else m  # (., ., R*bq|1, .)
            if m.shape[3] > 1:
                m = m.expand(*m.shape[:2], R * bq, Tk)
                m = m.gather(3, kv[None, None].expand(*m.shape[:2], -1, -1))  # (., ., R*bq, n)
            allowed = allowed & m
        allowed, row_has_key = open_empty_rows(allowed.expand_as(s))
        w = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)  # (b, hq, R*bq, n)
        if row_has_key is not None:
            w = torch.where(row_has_key, w, 0.0)  # rows with no key: zero weights
        o = _ungrouped(_grouped(w, hk, gg, R, bq) @ vc, gg, bq)  # (b, hq, R*bq, d_v)
        valid = (raw < Tq).flatten()  # (R*bq,) rows inside the sequence
        out[bs, hs, raw.flatten()[valid]] = o[:, :, valid]
    return out
