"""The seeds' math, written to be read beside them — and the test oracle.

Shape legend: B batch, h query heads, h_kv key/value heads, Tq/Tk query/key lengths,
d_k query/key head dim, d_v value head dim, d_model model width.

Seed 000 (independent W_i^Q, W_i^K, W_i^V per head, loop, concat, W_O)::

    Q_i = X W_i^Q,  K_i = X W_i^K,  V_i = X W_i^V              (B, T, d_k) / (B, T, d_v)
    A_i = softmax(Q_i K_i^T / sqrt(d_k))                         (B, Tq, Tk)
    head_i = A_i V_i                                             (B, Tq, d_v)
    Y = Concat(head_1, ..., head_h) W_O                          (B, Tq, d_model)

Everything here is a plain loop over heads; nothing is fused. ``upcast=True`` computes in
float64, which is how the tests use it as the oracle.
"""

from __future__ import annotations

import math

import torch

from mha.masks import open_empty_rows
from mha.nonfinite import any_nonfinite, masked_attention
from mha.scores import ScoreSpec


def head_attention(q_i: torch.Tensor, k_i: torch.Tensor, v_i: torch.Tensor, *,
                   allowed: torch.Tensor | None = None, scale: float | None = None,
                   dropout_p: float = 0.0, softcap: float | None = None,
                   bias: torch.Tensor | None = None, slope: torch.Tensor | None = None,
                   sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One head: ``softmax(Q_i K_i^T * scale) V_i`` (seed 004, Step 4), with the score variants
    of :mod:`mha.scores` written out.

    q_i ``(B, Tq, d_k)``, k_i ``(B, Tk, d_k)``, v_i ``(B, Tk, d_v)``, allowed broadcastable to
    ``(B, Tq, Tk)`` (True = may attend). Variants of this head: ``bias`` broadcastable to
    ``(B, Tq, Tk)``, ``slope`` ``(B|1,)`` (ALiBi), ``sink`` a 0-d logit.
    Returns ``(head_i (B, Tq, d_v), A_i (B, Tq, Tk))``.
    Query rows with no allowed key get zero weights and a zero output. A NaN or Inf in a key or
    value a row may not attend never reaches that row (:mod:`mha.nonfinite`).
    """
    scale = 1.0 / math.sqrt(q_i.shape[-1]) if scale is None else scale
    B, Tq, Tk = q_i.shape[0], q_i.shape[1], k_i.shape[1]
    if any_nonfinite(q_i, k_i, v_i, *(t for t in (bias,) if t is not None)):  # pairwise-exact
        a = torch.ones(B, Tq, Tk, dtype=torch.bool) if allowed is None else allowed.expand(B, Tq, Tk)
        one_head = ScoreSpec(softcap=softcap,  # this head's variants, as a 1-head spec
                             sinks=None if sink is None else sink.reshape(1),
                             bias=None if bias is None else bias[:, None],
                             alibi_slopes=None if slope is None else slope.reshape(-1, 1))
        out, A = masked_attention(q_i[:, None], k_i[:, None], v_i[:, None], a[:, None],  # 1 head
                                  scale, dropout_p, one_head)  # (B, 1, Tq, d_v), (B, 1, Tq, Tk)
        return out[:, 0], A[:, 0]
    scores = q_i @ k_i.transpose(-2, -1) * scale  # (B, Tq, d_k) @ (B, d_k, Tk) -> (B, Tq, Tk)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias  # broadcast (B|1, Tq|1, Tk|1)
    if slope is not None:
        i = torch.arange(Tq, dtype=scores.dtype).reshape(Tq, 1)
        j = torch.arange(Tk, dtype=scores.dtype).reshape(1, Tk)
        distance = i + (Tk - Tq) - j  # (Tq, Tk): how far key j lies before the diagonal
        scores = scores - slope.reshape(-1, 1, 1) * distance  # (B|1, 1, 1) * (Tq, Tk)
    row_has_key = None
    if allowed is not None:
        allowed, row_has_key = open_empty_rows(allowed.expand_as(scores))
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sink is None:
        A = torch.softmax(scores, dim=-1)  # (B, Tq, Tk), each row sums to 1
    else:  # the sink is one more logit in each row, with no value
        sink_column = sink.reshape(1, 1, 1).expand(B, Tq, 1)  # (B, Tq, 1)
        A = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)  # (B, Tq, Tk + 1)
        A = A[:, :, :Tk]  # (B, Tq, Tk): the sink's weight dropped, rows sum to < 1
    if row_has_key is not None:
        A = torch.where(row_has_key, A, 0.0)  # fully masked rows: zero weights
    A_used = torch.nn.functional.dropout(A, dropout_p) if dropout_p > 0 else A
    return A_used @ v_i, A  # (B, Tq, Tk) @ (B, Tk, d_v) -> (B, Tq, d_v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              allowed: torch.Tensor | None = None, scale: float | None = None,
              dropout_p: float = 0.0, upcast: bool = False, softcap: float | None = None,
              sinks: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              alibi_slopes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All heads, one at a time. q ``(B, h, Tq, d_k)``, k ``(B, h_kv, Tk, d_k)``,
    v ``(B, h_kv, Tk, d_v)``; query head ``i`` reads K/V head ``i // (h // h_kv)``.

    Score variants (:mod:`mha.scores`): ``softcap`` float, ``sinks`` ``(h,)``, ``bias``
    broadcastable to ``(B, h, Tq, Tk)``, ``alibi_slopes`` ``(h,)`` or ``(B, h)``.

    Returns ``(out (B, h, Tq, d_v), weights (B, h, Tq, Tk))`` in q's dtype (computed in float64
    when ``upcast``; the variant tensors too).
    """
    dtype = q.dtype
    compute = torch.float64 if upcast else dtype

    def as_4d(t):  # any shape broadcastable to (B, h, Tq, Tk) -> 4-D
        return None if t is None else t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))

    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    allowed = as_4d(allowed)
    bias = None if bias is None else as_4d(bias.to(compute))
    sinks = None if sinks is None else sinks.to(compute)
    if alibi_slopes is not None:  # (h,) or (B, h) -> (1|B, h)
        alibi_slopes = alibi_slopes.to(compute).reshape(-1, q.shape[1])
    h, h_kv = q.shape[1], k.shape[1]
    group = h // h_kv
    outs, weights = [], []
    for i in range(h):
        a_i = None if allowed is None else allowed[:, i if allowed.shape[1] > 1 else 0]
        head_i, A_i = head_attention(
            q[:, i], k[:, i // group], v[:, i // group], allowed=a_i, scale=scale,
            dropout_p=dropout_p, softcap=softcap,
            bias=None if bias is None else bias[:, i if bias.shape[1] > 1 else 0],
            slope=None if alibi_slopes is None else alibi_slopes[:, i],
            sink=None if sinks is None else sinks[i])
        outs.append(head_i)  # (B, Tq, d_v)
        weights.append(A_i)  # (B, Tq, Tk)
    out = torch.stack(outs, dim=1)  # h x (B, Tq, d_v) -> (B, h, Tq, d_v)
    w = torch.stack(weights, dim=1)  # h x (B, Tq, Tk) -> (B, h, Tq, Tk)
    return out.to(dtype), w.to(dtype)


def multi_head_attention(x_q: torch.Tensor, x_kv: torch.Tensor, *,
                         W_q: list[torch.Tensor], W_k: list[torch.Tensor], W_v: list[torch.Tensor],
                         W_o: torch.Tensor, b_q: list[torch.Tensor] | None = None,
                         b_k: list[torch.Tensor] | None = None,
                         b_v: list[torch.Tensor] | None = None, b_o: torch.Tensor | None = None,
                         allowed: torch.Tensor | None = None, scale: float | None = None,
                         upcast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Seed 000 end to end, one head at a time, with independent per-head weights.

    x_q ``(B, Tq, d_model)``, x_kv ``(B, Tk, kdim)``; ``W_q[i]`` ``(d_model, d_k)``,
    ``W_k[j]`` ``(kdim, d_k)``, ``W_v[j]`` ``(kdim, d_v)`` for each query head i and K/V head j
    (``len(W_k) = h_kv`` divides ``len(W_q) = h``); ``W_o`` ``(h * d_v, d_model)``.
    Returns ``(Y (B, Tq, d_model), weights (B, h, Tq, Tk))``.
    """
    dtype = x_q.dtype

    def up(t):
        return None if t is None else (t.double() if upcast else t)

    x_q, x_kv, W_o, b_o = up(x_q), up(x_kv), up(W_o), up(b_o)
    if allowed is not None:  # any shape broadcastable to (B, h, Tq, Tk) -> 4-D
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
    h, h_kv = len(W_q), len(W_k)
    group = h // h_kv
    heads, weights = [], []
    for i in range(h):
        j = i // group
        Q_i = x_q @ up(W_q[i])  # (B, Tq, d_model) @ (d_model, d_k) -> (B, Tq, d_k)
        K_i = x_kv @ up(W_k[j])  # (B, Tk, kdim) @ (kdim, d_k) -> (B, Tk, d_k)
        V_i = x_kv @ up(W_v[j])  # (B, Tk, kdim) @ (kdim, d_v) -> (B, Tk, d_v)
        if b_q is not None:
            Q_i, K_i, V_i = Q_i + up(b_q[i]), K_i + up(b_k[j]), V_i + up(b_v[j])
        a_i = None if allowed is None else allowed[:, i if allowed.shape[1] > 1 else 0]
        head_i, A_i = head_attention(Q_i, K_i, V_i, allowed=a_i, scale=scale)
        heads.append(head_i)  # (B, Tq, d_v)
        weights.append(A_i)  # (B, Tq, Tk)
    concat = torch.cat(heads, dim=-1)  # h x (B, Tq, d_v) -> (B, Tq, h * d_v)
    Y = concat @ W_o  # (B, Tq, h * d_v) @ (h * d_v, d_model) -> (B, Tq, d_model)
    if b_o is not None:
        Y = Y + b_o
    return Y.to(dtype), torch.stack(weights, dim=1).to(dtype)  # (B, h, Tq, Tk)
