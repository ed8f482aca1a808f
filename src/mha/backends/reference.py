"""Backend ``reference``: the seeds' per-head loop (``mha.reference``). Slow, readable, exact."""

from __future__ import annotations

import torch

from mha import reference
from mha.backends.base import ALL_MASK_KINDS, AttentionCall, Backend, Capabilities
from mha.scores import VARIANT_KINDS


def _forward(call: AttentionCall):
    allowed = call.masks.materialize(call.B, call.h, call.Tq, call.Tk, call.device)
    sc = call.scores
    out, w = reference.attention(call.q, call.k, call.v, allowed=allowed, scale=call.scale,
                                 dropout_p=call.dropout_p, softcap=sc.softcap, sinks=sc.sinks,
                                 bias=sc.bias, alibi_slopes=sc.alibi_slopes)
    return out, (w if call.return_weights else None)


BACKEND = Backend(
    name="reference",
    summary="per-head loop as in seed 000 (the test oracle); any device, any float dtype",
    caps=Capabilities(
        devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
        dtypes=frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16}),
        mask_kinds=ALL_MASK_KINDS,
        dropout=True, weights=True, grad=True, variants=VARIANT_KINDS,
    ),
    forward=_forward,
)
