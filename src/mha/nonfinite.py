"""NaN and Inf under masks: the rule every backend follows, and the exact dense path for it.

Shape legend: B batch, h query heads, h_kv key/value heads (h_kv divides h), Tq/Tk lengths,
d_k/d_v head dims, C a chunk of query rows.

The rule (README, "Guarantees"):

1. Query row ``i`` is computed from ``q_i`` and the K/V rows of the keys it **may attend**
   (mask AND causal AND window AND ``j < key_lengths[b]``). A NaN or ±Inf among those makes the
   row non-finite the way IEEE arithmetic of ``softmax(q k^T * scale) v`` does — as SDPA does for
   an unmasked call.
2. K/V rows that row ``i`` may **not** attend never affect row ``i``, its weights or its
   gradients. (A dense ``P @ V`` breaks this: a masked pair has ``P = 0`` and ``0 * NaN = NaN``.
   SDPA's CPU kernels leak this way depending on their block size.)
3. A row that may attend no key returns zeros, with zero gradients, whatever ``q_i`` holds. A
   score of ``-inf`` (an infinite key) weighs exactly 0, like an additive ``-inf`` mask: a row
   whose every visible score is ``-inf`` counts as a row with no key (zeros), as in the native
   kernels, which know an empty row by its zero softmax denominator.

The dense backends (``math``, ``sdpa``, ``reference``) compute their usual matmul formula when
every input is finite. Otherwise they call :func:`masked_attention`, which never multiplies a masked pair: each (row, key) pair is
gated with ``where`` *before* any product, so neither the forward nor autograd's backward forms
``0 * NaN``. It materializes ``(C, Tk, d)`` per chunk of rows, which is fine for a path that only
runs on non-finite input.
"""

from __future__ import annotations

import torch

from mha.scores import ScoreSpec

_CHUNK_ELEMENTS = 1 << 22  # elements of one (B, h, C, Tk, d) gated product


def any_nonfinite(*tensors: torch.Tensor) -> bool:
    """True when any tensor holds a NaN or ±Inf (one pass over each).

    Always False while ``torch.compile`` traces (a data-dependent branch would break the
    graph): compiled code follows the backend's own arithmetic for masked non-finite values.
    Always True under ``torch.vmap`` (which cannot branch on values either): the exact path of
    :func:`masked_attention` is right for any input, finite or not.
    """
    if torch.compiler.is_compiling():
        return False
    if any(torch._C._functorch.is_batchedtensor(t) for t in tensors):
        return True
    return any(not bool(torch.isfinite(t).all()) for t in tensors if t.numel())


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     scale: float, dropout_p: float = 0.0,
                     scores: ScoreSpec | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T * scale) v`` over the allowed pairs only, exactly as the rule says.
    ``scores``: the call's score variants (softcap, bias, ALiBi, sinks), applied to each chunk
    of rows; a masked pair's bias is replaced by ``-inf`` before any use.

    q ``(B, h, Tq, d_k)``, k ``(B, h_kv, Tk, d_k)``, v ``(B, h_kv, Tk, d_v)``, allowed bool
    broadcastable to ``(B, h, Tq, Tk)`` (True = may attend). Returns ``(out (B, h, Tq, d_v),
    weights (B, h, Tq, Tk))``; rows with no allowed key give zeros.
    """
    B, h, Tq, d_k = q.shape
    h_kv, Tk, d_v = k.shape[1], k.shape[2], v.shape[3]
    g = h // h_kv
    kh = k.repeat_interleave(g, dim=1) if g > 1 else k  # (B, h_kv, Tk, d_k) -> (B, h, Tk, d_k)
    vh = v.repeat_interleave(g, dim=1) if g > 1 else v  # (B, h_kv, Tk, d_v) -> (B, h, Tk, d_v)
    allowed = allowed.expand(B, h, Tq, Tk)
    rows = max(1, min(Tq, _CHUNK_ELEMENTS // max(1, B * h * Tk * max(d_k, d_v))))
    outs, weights = [], []
    zero = q.new_zeros(())
    for i0 in range(0, Tq, rows):
        vis = allowed[:, :, i0:i0 + rows]  # (B, h, C, Tk)
        # every product below sees 0 in place of a masked key: nothing masked is ever read
        k_pair = torch.where(vis[..., None], kh[:, :, None], zero)  # (B, h, C, Tk, d_k)
        s = (q[:, :, i0:i0 + rows, None, :] * k_pair).sum(-1) * scale  # (B, h, C, Tk)
        if scores is not None:
            s = scores.modify(s, Tq, rows=slice(i0, i0 + rows))  # (B, h, C, Tk)
        s = s.masked_fill(~vis, float("-inf"))
        has_key = (s != float("-inf")).any(-1, keepdim=True)  # (B, h, C, 1); NaN counts
        s = torch.where(has_key, s, zero)  # empty rows: a finite dummy row, zeroed below
        p = torch.softmax(s, dim=-1) if scores is None else scores.softmax(s)  # (B, h, C, Tk)
        w = torch.where(has_key, p, zero)  # (B, h, C, Tk)
        used = torch.nn.functional.dropout(w, dropout_p) if dropout_p > 0 else w
        v_pair = torch.where(vis[..., None], vh[:, :, None], zero)  # (B, h, C, Tk, d_v)
        outs.append((used[..., None] * v_pair).sum(-2))  # (B, h, C, d_v)
        weights.append(w)
    return torch.cat(outs, dim=2), torch.cat(weights, dim=2)  # (B, h, Tq, d_v), (B, h, Tq, Tk)
