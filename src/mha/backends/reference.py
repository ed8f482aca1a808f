"""Backend ``reference``: the seeds' per-head loop (``mha.reference``). Slow, readable, exact."""

from __future__ import annotations

import torch

from mha import reference
from mha.backends.base import MOD_MASK_KINDS, AttentionCall, Backend, Capabilities
from mha.scores import VARIANT_KINDS


def _forward(call: AttentionCall):
    allowed = call.masks.materialize(call.B, call.h, call.Tq, call.Tk, call.device)
    if call.score_mod is not None:  # the dense formula in float64 (mha.blocksparse)
        from mha.blocksparse import dense_attention

        out, w = dense_attention(call.q.double(), call.k.double(), call.v.double(),
                                 allowed=allowed, scale=call.scale, score_mod=call.score_mod,
                                 dropout_p=call.dropout_p)
        return out.to(call.dtype), (w.to(call.dtype) if call.return_weights else None)
    sc = call.scores
    out, w = reference.attention(call.q, call.k, call.v, allowed=allowed, scale=call.scale,
                                 dropout_p=call.dropout_p, softcap=sc.softcap, sinks=sc.sinks,
                                 bias=sc.bias, alibi_slopes=sc.alibi_slopes)
    if call.return_lse:
        return out, _lse(call, allowed)
    return out, (w if call.return_weights else None)


def _lse(call: AttentionCall, allowed) -> torch.Tensor:
    """``(B, h, Tq)``: log of each row's softmax denominator, computed in float64 head by head
    as the seeds write the scores (query head ``hq`` reads K/V head ``hq // g``)."""
    g = call.h // call.h_kv
    rows = []
    for hq in range(call.h):
        q = call.q[:, hq].double()  # (B, Tq, d_k)
        k = call.k[:, hq // g].double()  # (B, Tk, d_k)
        rows.append((q @ k.transpose(-2, -1)) * call.scale)  # (B, Tq, Tk)
    s = call.scores.modify(torch.stack(rows, dim=1), call.Tq)  # (B, h, Tq, Tk)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return call.scores.logsumexp(s).float()  # (B, h, Tq)


BACKEND = Backend(
    name="reference",
    summary="per-head loop as in seed 000 (the test oracle); any device, any float dtype",
    caps=Capabilities(
        devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
        dtypes=frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16}),
        mask_kinds=MOD_MASK_KINDS,
        dropout=True, weights=True, lse=True, grad=True, variants=VARIANT_KINDS, alibi_grad=True,
        score_mod=True,
    ),
    forward=_forward,
    extra_reasons=lambda call: (["cannot return the log-sum-exp together with a score_mod"]
                                if call.return_lse and call.score_mod is not None else []),
)
