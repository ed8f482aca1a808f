"""Ring, context-parallel and Ulysses attention train, and the zig-zag layout balances causal
work (gloo, this machine).

Shape legend: W ranks, B batch, h / h_kv heads, Tq / Tk full lengths, d_k / d_v dims.
Each spawn runs every case on W processes; every rank checks its slice of the outputs and of
the gradients of q, k and v against the full single-process problem (mha.attention with
autograd, float32; the repo's float64 oracle checks that problem elsewhere).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp


def _shapes(W):
    """(B, h, h_kv, Tq, Tk, d_k, d_v): GQA, d_v != d_k, Tq != Tk; lengths split into 2W chunks."""
    return [(1, 4, 2, 4 * W, 4 * W, 16, 24), (2, 4, 4, 2 * W, 6 * W, 16, 16)]


# (causal, window)
MASKINGS = [(False, None), (True, None), (True, 5)]


def _problem(shape, seed):
    B, h, h_kv, Tq, Tk, d_k, d_v = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, Tq, d_k, generator=g)
    k = torch.randn(B, h_kv, Tk, d_k, generator=g)
    v = torch.randn(B, h_kv, Tk, d_v, generator=g)
    go = torch.randn(B, h, Tq, d_v, generator=g)
    return q, k, v, go


def _worker(rank: int, W: int, init_file: str) -> None:
    import torch.distributed as dist

    import mha
    from mha import distributed as D

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=W)
    try:
        for seed, shape in enumerate(_shapes(W)):
            q, k, v, go = _problem(shape, seed)
            for causal, window in MASKINGS:
                full = [t.clone().requires_grad_() for t in (q, k, v)]
                out = mha.attention(*full, causal=causal, window=window)
                want = torch.autograd.grad((out * go).sum(), full)
                for layout in D.LAYOUTS:
                    sh = dict(world=W, rank=rank, layout=layout)
                    local = [D.shard(t, **sh).clone().requires_grad_() for t in (q, k, v)]
                    strategies = [("ring", D.ring_attention),
                                  ("context", D.context_parallel_attention)]
                    if shape[1] % W == 0 and shape[2] % W == 0:
                        strategies.append(("ulysses", D.ulysses_attention))
                    for name, fn in strategies:
                        got_out = fn(*local, causal=causal, window=window, layout=layout)
                        got = torch.autograd.grad((got_out * D.shard(go, **sh)).sum(), local)
                        tag = f"W={W} {shape} causal={causal} window={window} {layout} {name}"
                        torch.testing.assert_close(got_out, D.shard(out.detach(), **sh),
                                                   rtol=1e-5, atol=1e-5, msg=lambda m, tag=tag: f"{tag}: out {m}")
                        for n, a, b in zip("qkv", got, want, strict=True):
                            torch.testing.assert_close(a, D.shard(b, **sh), rtol=1e-4, atol=1e-5,
                                                       msg=lambda m, n=n, tag=tag: f"{tag}: d{n} {m}")
                    if ("ulysses", D.ulysses_attention) not in strategies:  # heads do not split
                        with pytest.raises(ValueError, match="multiples of the group size"):
                            D.ulysses_attention(*local, causal=causal, layout=layout)
                    # unshard puts every rank's rows back in sequence order
                    assert torch.equal(D.unshard(D.shard(q, **sh), layout=layout), q)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("W", [2, 3, 4])
def test_ring_and_context_parallel_gradients_equal_the_full_problem(W, tmp_path):
    mp.spawn(_worker, args=(W, str(tmp_path / "rendezvous")), nprocs=W, join=True)


def test_zigzag_balances_causal_work():
    from mha import distributed as D

    for W in (2, 4, 8):
        T = 64 * W
        contiguous = D.visible_pairs(T, T, W, layout="contiguous")
        zigzag = D.visible_pairs(T, T, W, layout="zigzag")
        assert sum(contiguous) == sum(zigzag) == T * (T + 1) // 2
        assert max(zigzag) == min(zigzag), zigzag  # every rank the same number of pairs
        assert max(contiguous) > 2 * min(contiguous)  # the last rank does most of the work


def test_layout_refuses_lengths_that_do_not_split():
    from mha import distributed as D

    with pytest.raises(ValueError, match="multiple of 6"):
        D.positions(16, 3, 0, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        D.positions(16, 2, 0, "spiral")
