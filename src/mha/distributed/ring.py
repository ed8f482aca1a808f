"""Ring attention: K/V shards passed round the ranks, partial results merged by log-sum-exp.

Shape legend: W ranks, r this rank, B batch, h / h_kv heads, n_q / n_k shard lengths,
Tq = W n_q and Tk = W n_k the full lengths, d_k / d_v head dims.

Forward: at step t rank r holds the K/V shard of rank ``(r - t) mod W``, sends it on to
``r + 1`` while it attends to it (one ``isend`` / ``irecv`` pair per tensor), and merges the
partial ``(out_s, lse_s)`` of each shard (``mha.attention(..., return_lse=True)``, through
dispatch) into ``out = sum_s exp(lse_s - lse) out_s``, ``lse = log sum_s exp(lse_s)`` — exact,
the flash-attention rescaling across processes. Never more than two K/V shards in memory.

Backward (flash-attention's recomputation): the shards travel round the ring again, each with
a dK / dV accumulator. For the shard it holds, a rank recomputes its partial ``(out_s, lse_s)``
and backpropagates the merge into it — ``d out_s = w_s dO`` and ``d lse_s = w_s (<dO, out_s> -
<dO, out>)`` row by row, with ``w_s = exp(lse_s - lse)`` — adding dQ to its own and dK_s, dV_s
to the accumulators, which then move on with the shard; after the last step each accumulator
takes one more hop home. Memory stays two K/V shards plus their accumulators.

Masks are mha's, on the full ``(Tq, Tk)`` problem: ``causal`` bottom-right, ``window``; the
``layout`` (``"contiguous"`` / ``"zigzag"``, :mod:`mha.distributed.layout`) says which global
rows each shard holds, and the (query, key) pairs a shard pair may meet follow from it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mha.distributed.layout import positions, visible
from mha.distributed.sequence import _check_shards


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   scale: float | None = None, window: int | None = None,
                   layout: str = "contiguous", group=None) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence, the K/V shards passed round a
    ring and merged by log-sum-exp (never more than two shards in memory). Differentiable
    with respect to q, k and v (every rank must then run the backward: it is a ring too).

    Args and shapes as in :func:`mha.distributed.context_parallel_attention` (no dropout).
    Returns ``(B, h, n_q, d_v)``.
    """
    W, r = _check_shards(q, k, v, group, causal=causal, scale=scale, layout=layout,
                         window=window)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    ring = _Ring(group, W, r, q.shape[2], k.shape[2], causal, scale, window, layout)
    return _RingAttention.apply(q, k, v, ring)


class _Ring:
    """The ring's geometry: neighbours, and which pairs a query shard and a key shard meet."""

    def __init__(self, group, W, r, n_q, n_k, causal, scale, window, layout):
        self.group, self.W, self.r, self.causal, self.scale = group, W, r, causal, scale
        self.window, self.layout = window, layout
        self.Tq, self.Tk = W * n_q, W * n_k
        peers = ((r + 1) % W, (r - 1) % W)
        self.next, self.prev = (dist.get_global_rank(group, i) for i in peers) \
            if group is not None else peers
        self.pos_q = positions(self.Tq, W, r, layout)

    def allowed(self, src: int):
        """For the K/V shard of rank ``src``: None (every pair visible), False (none), or the
        ``(n_q, n_k)`` bool mask."""
        m = visible(self.pos_q, positions(self.Tk, self.W, src, self.layout), self.Tq, self.Tk,
                    self.causal, self.window)
        if m is not None and not bool(m.any()):
            return False
        return m

    def partial(self, q, k, v, src: int):
        """``(out_s (B, h, n_q, d_v) float32, lse_s (B, h, n_q))`` of one K/V shard through
        dispatch, or None when no query of this rank sees any of its keys."""
        from mha.functional import attention

        m = self.allowed(src)
        if m is False:
            return None
        mask = None if m is None else m.to(q.device)[None, None]  # (1, 1, n_q, n_k)
        out, lse = attention(q, k, v, mask=mask, scale=self.scale, return_lse=True)
        return out.float(), lse

    def shift(self, tensors, tag0: int = 0):
        """Send ``tensors`` to the next rank and receive the previous rank's (same shapes)."""
        incoming = tuple(torch.empty_like(t) for t in tensors)
        works = [dist.isend(t.contiguous(), self.next, group=self.group, tag=tag0 + i)
                 for i, t in enumerate(tensors)]
        works += [dist.irecv(t, self.prev, group=self.group, tag=tag0 + i)
                  for i, t in enumerate(incoming)]
        return incoming, works


def _merge(acc, part):
    """Two partial results over disjoint keys, rescaled by their log-sum-exps."""
    if acc is None:
        return part
    (o1, l1), (o2, l2) = acc, part  # (B, h, n_q, d_v), (B, h, n_q)
    lse = torch.logaddexp(l1, l2)  # (B, h, n_q)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)  # rows that see nothing stay 0
    w1 = torch.exp(l1 - safe)[..., None]  # (B, h, n_q, 1)
    w2 = torch.exp(l2 - safe)[..., None]
    return o1 * w1 + o2 * w2, lse


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        kv = (k.contiguous(), v.contiguous())
        acc = None
        for step in range(ring.W):
            src = (ring.r - step) % ring.W  # the rank whose K/V shard we hold now
            works = []
            if step < ring.W - 1:  # pass the shard on while attending to it
                incoming, works = ring.shift(kv)
            part = ring.partial(q, *kv, src)
            if part is not None:
                acc = _merge(acc, part)
            for w in works:
                w.wait()
            if step < ring.W - 1:
                kv = incoming
        B, h, n_q = q.shape[:3]
        if acc is None:  # no query of this shard sees any key
            acc = (q.new_zeros(B, h, n_q, v.shape[3], dtype=torch.float32),
                   q.new_full((B, h, n_q), float("-inf"), dtype=torch.float32))
        out, lse = acc
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out.to(q.dtype)  # (B, h, n_q, d_v)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        dout = dout.float()  # (B, h, n_q, d_v)
        safe = lse.masked_fill(lse == float("-inf"), 0.0)  # (B, h, n_q)
        d_dot_out = (dout * out).sum(-1)  # (B, h, n_q): <dO, out> per row
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = (k.contiguous(), v.contiguous())
        acc = (torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32))
        for step in range(ring.W):
            src = (ring.r - step) % ring.W
            works = []
            if step < ring.W - 1:
                incoming, works = ring.shift(kv)
            grads = _shard_grads(ring, q, *kv, src, dout, safe, d_dot_out)
            if grads is not None:
                dq += grads[0]
                acc = (acc[0] + grads[1], acc[1] + grads[2])
            for w in works:
                w.wait()
            # the accumulators follow their shard (and, after the last step, go home; with
            # one rank they are home: a send to itself is no gloo pair)
            if ring.W > 1:
                acc, acc_works = ring.shift(acc, tag0=2)
                for w in acc_works:
                    w.wait()
            if step < ring.W - 1:
                kv = incoming
        return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None


def _shard_grads(ring: _Ring, q, k, v, src: int, dout, lse_safe, d_dot_out):
    """``(dq, dk, dv)`` float32 of one K/V shard's part of the merged output, or None."""
    with torch.enable_grad():
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        part = ring.partial(qs, ks, vs, src)
        if part is None:
            return None
        out_s, lse_s = part  # (B, h, n_q, d_v), (B, h, n_q)
        w = torch.exp(lse_s.detach() - lse_safe)  # (B, h, n_q): this shard's share
        d_out_s = dout * w[..., None]  # (B, h, n_q, d_v)
        d_lse_s = w * ((dout * out_s.detach()).sum(-1) - d_dot_out)  # (B, h, n_q)
        dq, dk, dv = torch.autograd.grad((out_s, lse_s), (qs, ks, vs), (d_out_s, d_lse_s))
    return dq.float(), dk.float(), dv.float()
