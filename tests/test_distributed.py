"""mha.distributed: a sequence split over 3 processes (gloo, this machine) gives each rank its
rows of mha.attention on the full sequence — values and (context parallel) gradients.

Shape legend: W ranks, B batch, h / h_kv heads, n_q / n_k shard lengths, d_k / d_v dims.
One spawn runs every case (process start-up dominates); a failing rank's traceback fails the
test through torch.multiprocessing.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

W = 3
# (B, h, h_kv, n_q, n_k, d_k, d_v)
SHAPES = [(2, 4, 2, 8, 8, 16, 16), (1, 2, 1, 5, 11, 16, 24), (2, 2, 2, 9, 4, 32, 16)]


def _full(shape, dtype, seed):
    B, h, h_kv, n_q, n_k, d_k, d_v = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, W * n_q, d_k, generator=g)  # (B, h, Tq, d_k)
    k = torch.randn(B, h_kv, W * n_k, d_k, generator=g)  # (B, h_kv, Tk, d_k)
    v = torch.randn(B, h_kv, W * n_k, d_v, generator=g)  # (B, h_kv, Tk, d_v)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _shard(t, r):
    n = t.shape[2] // W
    return t[:, :, r * n:(r + 1) * n]  # (B, heads, n, d)


def _budget_check(got, q, k, v, causal, r, what):
    from mha.masks import causal_mask

    from oracle import FLOOR, max_err, naive, oracle

    allowed = causal_mask(q.shape[2], k.shape[2])[None, None] if causal else None
    ref, low = oracle(q, k, v, allowed)[0], naive(q, k, v, allowed)[0]
    budget = 2 * max_err(_shard(low, r), _shard(ref, r)) + FLOOR[q.dtype]
    err = max_err(got, _shard(ref, r))
    assert err <= budget, f"rank {r} {what}: error {err:.2e} > budget {budget:.2e}"


def _worker(rank: int, init_file: str) -> None:
    import torch.distributed as dist

    import mha
    from mha import distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=W)
    try:
        for seed, shape in enumerate(SHAPES):
            for dtype in (torch.float32, torch.bfloat16):
                for causal in (False, True):
                    q, k, v = _full(shape, dtype, seed)
                    qs, ks, vs = (_shard(t, rank) for t in (q, k, v))
                    with torch.no_grad():
                        ring = distributed.ring_attention(qs, ks, vs, causal=causal)
                        cp = distributed.context_parallel_attention(qs, ks, vs, causal=causal)
                    tag = f"{shape} {dtype} causal={causal}"
                    _budget_check(ring, q, k, v, causal, rank, "ring " + tag)
                    _budget_check(cp, q, k, v, causal, rank, "context-parallel " + tag)
        # gradients of context parallel = this rank's slice of the full problem's gradients
        for causal in (False, True):
            q, k, v = _full(SHAPES[1], torch.float32, 7)
            go = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[3],
                             generator=torch.Generator().manual_seed(1))  # (B, h, Tq, d_v)
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            want = torch.autograd.grad((mha.attention(*full, causal=causal) * go).sum(), full)
            local = [_shard(t, rank).clone().requires_grad_() for t in (q, k, v)]
            out = distributed.context_parallel_attention(*local, causal=causal)
            got = torch.autograd.grad((out * _shard(go, rank)).sum(), local)
            for name, a, b in zip("qkv", got, want, strict=True):
                err = (a - _shard(b, rank)).abs().max().item()
                assert err < 1e-4, f"rank {rank} d{name} causal={causal}: {err:.2e}"
        # refusals
        q, k, v = (_shard(t, rank) for t in _full(SHAPES[0], torch.float32, 0))
        bad = k[:, :, :-1] if rank == 1 else k  # one rank's shard is shorter
        with pytest.raises(ValueError, match="same shapes on every rank"):
            distributed.context_parallel_attention(q.detach(), bad, bad)
    finally:
        dist.destroy_process_group()


def test_sequence_split_over_three_processes(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"),), nprocs=W, join=True)


def test_needs_a_process_group():
    from mha import distributed

    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.ring_attention(q, q, q)


def test_a_group_of_one_process_gives_the_whole_answer(tmp_path):
    """World size 1 (a script run without a launcher): each strategy is mha.attention, values
    and gradients. Before, ring_attention's backward sent its accumulators to itself and gloo
    raised 'Pair is not connected'."""
    import torch.distributed as dist

    import mha
    from mha import distributed

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 4, 12, 16, generator=g)  # (B, h, T, d)
        k, v = (torch.randn(1, 2, 12, 16, generator=g) for _ in range(2))  # (B, h_kv, T, d)
        for fn in (distributed.ring_attention, distributed.ulysses_attention,
                   distributed.context_parallel_attention):
            for layout in ("contiguous", "zigzag"):
                got = [t.clone().requires_grad_() for t in (q, k, v)]
                want = [t.clone().requires_grad_() for t in (q, k, v)]
                fn(*got, causal=True, layout=layout).square().sum().backward()
                mha.attention(*want, causal=True).square().sum().backward()
                for a, b in zip(got, want, strict=True):
                    torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5,
                                               msg=lambda m, f=fn: f"{f.__name__}: {m}")
    finally:
        dist.destroy_process_group()
