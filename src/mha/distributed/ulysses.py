"""Head-parallel attention over a sequence split across ranks (DeepSpeed-Ulysses).

Shape legend: W ranks, B batch, h / h_kv heads, n_q / n_k shard lengths, Tq = W n_q and
Tk = W n_k the full lengths, d_k / d_v head dims.

Each rank holds a sequence shard of every head. One all-to-all turns that into every position
of h / W heads (rank j gets heads ``[j h / W, (j + 1) h / W)`` and K/V heads
``[j h_kv / W, (j + 1) h_kv / W)`` — the K/V heads its query heads read, so GQA needs no
repetition); the rank runs ``mha.attention`` on the whole sequence for its heads (any
backend, any mask of mha), and a second all-to-all gives every rank its sequence shard of all
heads back. Heads are the seeds' own unit of parallel work: nothing is merged, the result is
mha's to the bit. Each all-to-all moves a rank's shard once; the backward is the inverse
all-to-all of the gradients. Needs ``h % W == 0`` and ``h_kv % W == 0``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mha.distributed.layout import from_rank_order, positions
from mha.distributed.sequence import _check_shards


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      causal: bool = False, scale: float | None = None,
                      dropout_p: float = 0.0, window: int | None = None,
                      layout: str = "contiguous", backend: str | None = None,
                      group=None) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence, computed head-parallel.

    Args and shapes as in :func:`mha.distributed.context_parallel_attention`; ``h`` and
    ``h_kv`` must be multiples of the group's size. Returns ``(B, h, n_q, d_v)``,
    differentiable with respect to q, k and v.
    """
    from mha.functional import attention

    W, r = _check_shards(q, k, v, group, causal=causal, scale=scale, dropout_p=dropout_p,
                         layout=layout, window=window)
    h, h_kv = q.shape[1], k.shape[1]
    if h % W or h_kv % W:  # the shapes agree on every rank: every rank raises this
        raise ValueError(f"ulysses_attention splits heads over the ranks: h={h} and h_kv={h_kv} "
                         f"must be multiples of the group size {W} (use ring_attention or "
                         f"context_parallel_attention otherwise)")
    for t in (q, k):  # lengths that do not split in the layout: refused before any collective
        positions(W * t.shape[2], W, r, layout)
    qh, kh, vh = (_SeqToHeads.apply(t, group, W, layout) for t in (q, k, v))  # (B, heads/W, T, d)
    out = attention(qh, kh, vh, causal=causal, scale=scale, dropout_p=dropout_p, window=window,
                    backend=backend)  # (B, h/W, Tq, d_v), sequence order
    return _HeadsToSeq.apply(out, group, W, layout)  # (B, h, n_q, d_v)


def _seq_to_heads(x: torch.Tensor, group, W: int, layout: str) -> torch.Tensor:
    """``(B, H, n, d)`` sequence shard of all heads -> ``(B, H / W, W n, d)`` every position of
    this rank's heads, in sequence order."""
    B, H, n, d = x.shape
    send = x.reshape(B, W, H // W, n, d).transpose(0, 1).contiguous()  # (W, B, H/W, n, d)
    recv = torch.empty_like(send)  # recv[i]: rank i's shard of this rank's heads
    dist.all_to_all_single(recv, send, group=group)
    full = recv.permute(1, 2, 0, 3, 4).reshape(B, H // W, W * n, d)  # shards in rank order
    return from_rank_order(full, W, layout=layout)  # (B, H/W, T, d)


def _heads_to_seq(x: torch.Tensor, group, W: int, layout: str) -> torch.Tensor:
    """The inverse: ``(B, H / W, T, d)`` in sequence order -> ``(B, H, T / W, d)`` this rank's
    sequence shard of all heads."""
    B, Hw, T, d = x.shape
    n = T // W
    order = torch.cat([positions(T, W, i, layout) for i in range(W)]).to(x.device)  # (T,)
    ranked = x.index_select(2, order) if layout != "contiguous" else x  # rank order
    send = ranked.reshape(B, Hw, W, n, d).permute(2, 0, 1, 3, 4).contiguous()  # (W, B, H/W, n, d)
    recv = torch.empty_like(send)  # recv[j]: rank j's heads of this rank's shard
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(B, W * Hw, n, d)  # (B, H, n, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, W, layout):
        ctx.args = (group, W, layout)
        return _seq_to_heads(x, *ctx.args)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), *ctx.args), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, W, layout):
        ctx.args = (group, W, layout)
        return _heads_to_seq(x, *ctx.args)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), *ctx.args), None, None, None
