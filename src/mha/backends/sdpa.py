"""Backend ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``.

Shape legend: B batch, h heads, h_kv K/V heads, Tq/Tk lengths, d_k/d_v head dims.
Pure causal calls use SDPA's own ``is_causal`` when Tq == Tk (its alignment is top-left, which
equals ours only then); everything else passes the materialized bool mask (True = may attend,
SDPA's polarity too). A bias and ALiBi become one additive float ``attn_mask`` (with ``-inf``
where the bool masks forbid); SDPA cannot softcap or add a sink, so it rejects those with a
reason. Fully masked query rows are opened before SDPA and zeroed after, so the
output is zero and the gradients finite. A q, k or v whose rows overlap in memory (a view such
as ``as_strided`` with a row stride below the row length) is copied first: SDPA's CPU kernels
read such a q wrongly (torch 2.13: wrong values in every dtype, NaN in float16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mha.backends.base import ALL_MASK_KINDS, AttentionCall, Backend, Capabilities
from mha.masks import open_empty_rows
from mha.nonfinite import any_nonfinite, masked_attention


def _rows_apart(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a contiguous copy when its rows (last dim) overlap one another."""
    rows, width = t.shape[-2], t.shape[-1]
    overlap = rows > 1 and width > 1 and 0 < abs(t.stride(-2)) < width * abs(t.stride(-1))
    return t.contiguous() if overlap else t


def _forward(call: AttentionCall):
    B, h, Tq, Tk = call.B, call.h, call.Tq, call.Tk
    q, k, v = (_rows_apart(t) for t in (call.q, call.k, call.v))
    kwargs = dict(dropout_p=call.dropout_p, scale=call.scale, enable_gqa=call.h_kv != call.h)
    sc = call.scores
    if any_nonfinite(call.q, call.k, call.v, *(() if sc.bias is None else (sc.bias,))):
        # SDPA multiplies masked pairs (0 * NaN) in a block-size-dependent way, and its bf16
        # kernel drops +Inf scores; mha's rule is IEEE arithmetic over the keys a row may
        # attend (mha.nonfinite)
        allowed = call.masks.materialize(B, h, Tq, Tk, call.device)
        if allowed is None:
            allowed = torch.ones(1, 1, Tq, Tk, dtype=torch.bool, device=call.device)
        return masked_attention(q, k, v, allowed, call.scale,
                                call.dropout_p, sc)[0], None
    if call.masks.kinds == {"causal"} and Tq == Tk and sc.is_empty:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              **kwargs), None
    allowed = call.masks.materialize(B, h, Tq, Tk, call.device)
    row_has_key = None
    if allowed is not None:
        allowed, row_has_key = open_empty_rows(allowed)
    attn_mask = allowed
    if not sc.is_empty:  # bias and ALiBi: one additive float mask, -inf where not allowed
        attn_mask = sc.modify(call.q.new_zeros(1, 1, Tq, Tk), Tq)  # (B|1, h|1, Tq, Tk)
        if allowed is not None:
            attn_mask = attn_mask.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None and getattr(torch.compiler, "is_exporting", lambda: False)():
        # a graph for ONNX (mha.export): ONNX Runtime's Attention operator wants the mask's
        # query dim in full, not broadcast (a view here; one Expand in the graph)
        attn_mask = attn_mask.expand(*attn_mask.shape[:-2], Tq, Tk)  # (B|1, h|1, Tq, Tk)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)
    if row_has_key is not None:
        out = torch.where(row_has_key, out, 0.0)  # (B|1, h|1, Tq, 1): fully masked rows -> 0
    return out, None  # (B, h, Tq, d_v)


BACKEND = Backend(
    name="sdpa",
    summary="torch.nn.functional.scaled_dot_product_attention",
    caps=Capabilities(
        devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
        dtypes=frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16}),
        mask_kinds=ALL_MASK_KINDS,
        dropout=True, weights=False, grad=True, variants=frozenset({"bias", "alibi"}),
        alibi_grad=True,
        variant_gaps=(("softcap", "cannot be served: SDPA has no tanh cap inside its softmax"),
                      ("sinks", "cannot be served: SDPA has no sink logit in its softmax "
                                "denominator")),
    ),
    forward=_forward,
)
