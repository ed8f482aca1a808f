"""Backend ``blocksparse``: calls with a ``score_mod`` (:mod:`mha.mods`), and ``mask_mod`` calls
``flash_cpu`` cannot take (float64 / float16, other devices, head dims outside 16..256), walked
over a cached block plan in PyTorch ops (:mod:`mha.blocksparse`). A ``mask_mod`` alone on the CPU
in fp32 / bf16 goes to ``flash_cpu``, whose kernel walks the plan natively; a ``score_mod`` is an
arbitrary Python function of the scores, so it stays here.

Shape legend: B batch, h heads, h_kv K/V heads, Tq/Tk lengths, d_k/d_v head dims.
The plan is built from ``mask_mod`` AND ``causal`` AND ``window`` (so their EMPTY blocks are
skipped); ``key_lengths`` and ``mask`` are ANDed per visited block. It can serve plain calls
(forced, or for tests) but defers them to the dense backends. NaN / Inf inputs without a
``score_mod`` take the exact dense path of :mod:`mha.nonfinite`; with a ``score_mod`` they follow
IEEE arithmetic over the visited blocks (a masked non-finite key in a visited block can reach a
row, as in a dense matmul).
"""

from __future__ import annotations

import torch

from mha.backends.base import MOD_MASK_KINDS, AttentionCall, Backend, Capabilities
from mha.blockplan import block_plan
from mha.blocksparse import block_sparse_attention
from mha.masks import lengths_mask
from mha.mods import for_call
from mha.nonfinite import any_nonfinite, masked_attention


def _forward(call: AttentionCall):
    m = call.masks
    if call.score_mod is None and any_nonfinite(call.q, call.k, call.v):
        # a masked NaN/Inf key must never reach a row (mha.nonfinite): the exact gated path
        allowed = m.materialize(call.B, call.h, call.Tq, call.Tk, call.device)
        if allowed is None:  # a plain call, forced here
            allowed = torch.ones(1, 1, call.Tq, call.Tk, dtype=torch.bool, device=call.device)
        return masked_attention(call.q, call.k, call.v, allowed, call.scale)[0], None
    plan = block_plan(for_call(m.mask_mod, m.causal, m.window), call.B, call.h, call.Tq,
                      call.Tk, device=call.device)
    extra = m.mask
    if m.key_lengths is not None:
        lm = lengths_mask(m.key_lengths, call.Tk)  # (B, 1, 1, Tk)
        extra = lm if extra is None else extra & lm
    out = block_sparse_attention(call.q, call.k, call.v, plan, scale=call.scale,
                                 score_mod=call.score_mod, mask=extra)
    return out, None  # (B, h, Tq, d_v)


def _defers(call: AttentionCall) -> str | None:
    if "mask_mod" not in call.masks.kinds and call.score_mod is None:
        return "no mask_mod / score_mod: the dense backends serve plain calls in fewer steps"
    return None


BACKEND = Backend(
    name="blocksparse",
    summary="score_mod (and mask_mod beyond flash_cpu) over a cached block plan in PyTorch ops; "
            "skips empty blocks",
    caps=Capabilities(
        devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
        dtypes=frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16}),
        mask_kinds=MOD_MASK_KINDS,
        dropout=False, weights=False, grad=True, score_mod=True,
    ),
    forward=_forward,
    defers=_defers,
)
