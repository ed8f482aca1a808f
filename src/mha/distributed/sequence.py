"""Attention over a sequence split across processes (seed 001's "distributed computation").

Shape legend: W processes (ranks) in the group, r this rank, B batch, h / h_kv heads, n_q / n_k
this rank's query / key shard length, Tq = W n_q and Tk = W n_k the full lengths, d_k / d_v.

Every rank holds one contiguous shard of the sequence: queries ``q (B, h, n_q, d_k)`` for the
global rows ``[r n_q, (r + 1) n_q)``, keys/values ``(B, h_kv, n_k, d)`` for ``[r n_k, (r + 1)
n_k)``; shards have the same shape on every rank. The result is this rank's rows of
``mha.attention`` on the full sequence — the same numbers, ``causal`` bottom-right on the full
``(Tq, Tk)`` problem as everywhere in mha.

* :func:`context_parallel_attention` gathers K/V from every rank (an all-gather whose backward
  sums the key/value gradients back to their owners) and attends over the keys its queries may
  see — with ``causal``, rank r skips the later shards. Differentiable; K/V memory is the full
  ``Tk`` per rank.
* :func:`ring_attention` never holds more than two K/V shards: the shards travel round the
  ring (rank r sends to r + 1 while it attends to the one it has), and the partial results are
  merged with their log-sum-exps, ``out = sum_s exp(lse_s - lse) out_s`` with
  ``lse = log sum_s exp(lse_s)`` — exact, the flash-attention rescaling across processes.
  Inference only (no autograd through the ring).

Both work with any ``torch.distributed`` backend that has all-gather / all-reduce / send-recv
(gloo on CPU is what the tests use: two processes on one machine).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mha.checks import FLOAT_DTYPES, check_bool, check_qkv, check_scalar, check_window
from mha.distributed.layout import LAYOUTS, check_layout, from_rank_order, positions, visible


def _group_info(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("mha.distributed needs an initialized process group: call "
                           "torch.distributed.init_process_group(...) first")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be None (the default group) or a "
                        f"torch.distributed.ProcessGroup (dist.new_group(...)), got "
                        f"{type(group).__name__}")
    return dist.get_world_size(group), dist.get_rank(group)


def _check_shards(q, k, v, group, *, causal, scale, dropout_p=0.0, layout="contiguous",
                  window=None) -> tuple[int, int]:
    """Valid shards that agree across ranks, checked on every rank before any K/V moves.

    Each rank checks its own arguments, then one small all-gather exchanges a description of
    them (valid or not, dtype, shapes of q / k / v, causal, scale): a rank whose arguments are
    refused raises its own error and every other rank raises a ValueError naming it, and ranks
    that disagree (dtype, B, h, h_kv, lengths, d_k, d_v, causal, scale, whether a gradient is
    needed, layout, window) all raise the same ValueError listing every rank's view — instead
    of a mismatched collective aborting the process or waiting forever (a backward that runs
    on some ranks only would). Returns (W, r).
    """
    W, r = _group_info(group)
    error = None
    try:
        check_qkv(q, k, v)
        causal = check_bool("causal", causal)
        scale = None if scale is None else check_scalar("scale", scale, low=0.0)
        check_scalar("dropout_p", dropout_p, low=0.0, high=1.0, high_open=True)
        layout = check_layout(layout)
        window = None if window is None else check_window(window, causal)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    except (TypeError, ValueError, RuntimeError) as e:  # raised below, after the exchange
        error = e
    if error is None:
        row = [1.0, float(FLOAT_DTYPES.index(q.dtype)), *q.shape, *k.shape, *v.shape,
               float(causal), -1.0 if scale is None else scale, float(grad),
               float(LAYOUTS.index(layout)), 0.0 if window is None else float(window)]
    else:
        row = [0.0] * 19
    mine = torch.tensor(row, dtype=torch.float64)  # (19,) exact for sizes < 2^53
    every = [torch.empty_like(mine) for _ in range(W)]
    dist.all_gather(every, mine, group=group)
    refused = [rank for rank, t in enumerate(every) if t[0] == 0]
    if error is not None:
        raise error
    if refused:
        raise ValueError(f"q, k, v (or causal / scale) were refused on rank(s) {refused}; "
                         f"see the error raised there (every rank of the group raises)")
    if any(not torch.equal(t, every[0]) for t in every[1:]):
        views = "; ".join(f"rank {rank}: {_describe(t)}" for rank, t in enumerate(every))
        raise ValueError(f"q, k, v shards must have the same shapes on every rank, and the "
                         f"same dtype, causal, scale, requires_grad, layout and window: "
                         f"{views}")
    return W, r


def _describe(row: torch.Tensor) -> str:
    """One rank's exchanged description, in words."""
    vals = [int(x) for x in row[1:14].tolist()]
    scale = float(row[15])
    window = int(row[18]) or None
    return (f"{str(FLOAT_DTYPES[vals[0]]).replace('torch.', '')} q {tuple(vals[1:5])} "
            f"k {tuple(vals[5:9])} v {tuple(vals[9:13])} causal={bool(row[14])} "
            f"scale={'default' if scale < 0 else scale} requires_grad={bool(row[16])} "
            f"layout={LAYOUTS[int(row[17])]} window={window}")


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence dim (2); backward all-reduces the full gradient and keeps
    this rank's slice (all-reduce works on every backend, reduce-scatter does not)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        W, r = dist.get_world_size(group), dist.get_rank(group)
        ctx.group, ctx.r, ctx.n = group, r, x.shape[2]
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(W)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)  # W x (B, heads, n, d) -> (B, heads, W n, d)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()  # (B, heads, W n, d)
        dist.all_reduce(grad, group=ctx.group)  # every rank's contribution to every shard
        return grad[:, :, ctx.r * ctx.n:(ctx.r + 1) * ctx.n], None  # (B, heads, n, d)


def _visible_keys(r: int, W: int, n_q: int, n_k: int) -> int:
    """How many leading keys of the full sequence rank r's last query may see under causal:
    global query ``i`` sees ``j <= i + Tk - Tq``; its last row is ``(r + 1) n_q - 1``."""
    return max(0, min(W * n_k, (r + 1) * n_q + W * (n_k - n_q)))


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               causal: bool = False, scale: float | None = None,
                               dropout_p: float = 0.0, backend: str | None = None,
                               window: int | None = None, layout: str = "contiguous",
                               group=None) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence, K/V gathered from every rank.

    Args:
        q: ``(B, h, n_q, d_k)`` this rank's query shard; k ``(B, h_kv, n_k, d_k)`` and v
            ``(B, h_kv, n_k, d_v)`` its key/value shard (the same shapes on every rank).
        causal, scale, dropout_p, backend, window: as in :func:`mha.attention`, for the full
            sequence.
        layout: which rows each rank holds, ``"contiguous"`` or ``"zigzag"`` (balanced causal
            work; :mod:`mha.distributed.layout`), the same for queries and keys.
        group: the process group (None: the default group).

    Returns ``(B, h, n_q, d_v)``, differentiable with respect to q, k and v.
    """
    from mha.functional import attention

    W, r = _check_shards(q, k, v, group, causal=causal, scale=scale, dropout_p=dropout_p,
                         layout=layout, window=window)
    k_all = _GatherSeq.apply(k, group)  # (B, h_kv, Tk, d_k), shards in rank order
    v_all = _GatherSeq.apply(v, group)  # (B, h_kv, Tk, d_v)
    if layout == "contiguous" and window is None:
        if causal:  # keys past what the shard's last query sees are never needed
            J = _visible_keys(r, W, q.shape[2], k.shape[2])
            k_all, v_all = k_all[:, :, :J], v_all[:, :, :J]  # (B, h_kv, J, d)
        return attention(q, k_all, v_all, causal=causal, scale=scale, dropout_p=dropout_p,
                         backend=backend)  # (B, h, n_q, d_v)
    k_all = from_rank_order(k_all, W, layout=layout)  # (B, h_kv, Tk, d_k), sequence order
    v_all = from_rank_order(v_all, W, layout=layout)  # (B, h_kv, Tk, d_v)
    Tq, Tk = W * q.shape[2], W * k.shape[2]
    allowed = visible(positions(Tq, W, r, layout), torch.arange(Tk), Tq, Tk, causal, window)
    mask = None if allowed is None else allowed.to(q.device)[None, None]  # (1, 1, n_q, Tk)
    return attention(q, k_all, v_all, mask=mask, scale=scale, dropout_p=dropout_p,
                     backend=backend)  # (B, h, n_q, d_v)
