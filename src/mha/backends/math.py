"""Backend ``math``: all heads at once with batched matmuls (seed 004, Steps 4–5).

Shape legend: B batch, h heads, h_kv K/V heads, g = h // h_kv, Tq/Tk lengths, d_k/d_v dims.
GQA is served without repeating K/V: the query heads of a group are folded into the query
length, so each K/V head is read by one matmul.
"""

from __future__ import annotations

import torch

from mha.backends.base import ALL_MASK_KINDS, AttentionCall, Backend, Capabilities
from mha.masks import open_empty_rows
from mha.nonfinite import any_nonfinite, masked_attention
from mha.scores import VARIANT_KINDS


def _forward(call: AttentionCall):
    out, weights = _attend(call)
    return out, (_lse(call) if call.return_lse else weights)


def _lse(call: AttentionCall) -> torch.Tensor:
    """``(B, h, Tq)`` float32: the log of each row's softmax denominator (sink included), from
    the scores in at least float32 with masked pairs at -inf (a masked NaN is never read)."""
    B, h, h_kv, Tq, Tk = call.B, call.h, call.h_kv, call.Tq, call.Tk
    wide = torch.promote_types(call.dtype, torch.float32)
    qg = call.q.to(wide).reshape(B, h_kv, (h // h_kv) * Tq, call.d_k)  # (B, h_kv, g*Tq, d_k)
    s = (qg @ call.k.to(wide).transpose(-2, -1)) * call.scale  # (B, h_kv, g*Tq, Tk)
    s = call.scores.modify(s.view(B, h, Tq, Tk), Tq)  # (B, h, Tq, Tk)
    allowed = call.masks.materialize(B, h, Tq, Tk, call.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return call.scores.logsumexp(s).float()  # (B, h, Tq)


def _attend(call: AttentionCall):
    q, k, v = call.q, call.k, call.v
    B, h, h_kv, Tq, Tk = call.B, call.h, call.h_kv, call.Tq, call.Tk
    sc = call.scores
    allowed = call.masks.materialize(B, h, Tq, Tk, call.device)
    if any_nonfinite(q, k, v, *(() if sc.bias is None else (sc.bias,))):
        # masked NaN/Inf are never read (mha.nonfinite)
        if allowed is None:
            allowed = torch.ones(1, 1, Tq, Tk, dtype=torch.bool, device=call.device)
        out, weights = masked_attention(q, k, v, allowed, call.scale, call.dropout_p, sc)
        return out, (weights if call.return_weights else None)
    g = h // h_kv
    qg = q.reshape(B, h_kv, g * Tq, call.d_k)  # (B, h, Tq, d_k) -> (B, h_kv, g*Tq, d_k)
    scores = (qg @ k.transpose(-2, -1)) * call.scale  # (B, h_kv, g*Tq, Tk)
    scores = scores.view(B, h, Tq, Tk)  # (B, h_kv, g*Tq, Tk) -> (B, h, Tq, Tk)
    scores = sc.modify(scores, Tq)  # softcap, + bias, - ALiBi distance (mha.scores)
    row_has_key = None
    if allowed is not None:
        allowed, row_has_key = open_empty_rows(allowed)
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = sc.softmax(scores)  # (B, h, Tq, Tk), a sink in the denominators when given
    if row_has_key is not None:
        weights = torch.where(row_has_key, weights, 0.0)  # fully masked rows: zero weights
    used = torch.nn.functional.dropout(weights, call.dropout_p) if call.dropout_p > 0 else weights
    used = used.reshape(B, h_kv, g * Tq, Tk)  # (B, h, Tq, Tk) -> (B, h_kv, g*Tq, Tk)
    out = (used @ v).view(B, h, Tq, call.d_v)  # (B, h_kv, g*Tq, d_v) -> (B, h, Tq, d_v)
    return out, (weights if call.return_weights else None)


BACKEND = Backend(
    name="math",
    summary="batched matmul + softmax (seed 004); returns weights; materializes (Tq, Tk)",
    caps=Capabilities(
        devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
        dtypes=frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16}),
        mask_kinds=ALL_MASK_KINDS,
        dropout=True, weights=True, lse=True, grad=True, variants=VARIANT_KINDS, alibi_grad=True,
    ),
    forward=_forward,
)
