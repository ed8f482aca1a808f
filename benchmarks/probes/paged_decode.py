"""Paged vs contiguous K/V in the decode kernel: one decode step (B, 32, 1, Tk, 128) reading a
dense cache and the same keys scattered over a page pool (random block table), side by side in
one process (round-robin medians, ``_timing.interleaved``).

Run (under the timing lock, see docs/kernel.md):
    flock -x /tmp/mha-bench.lock env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
        .venv/bin/python benchmarks/probes/paged_decode.py --Tk 4096 8192 16384 32768

Per Tk and K/V storage (fp32, bf16, int8 with its scales): ms per step for the contiguous
cache (``flash_decode`` on a ``(B, h_kv, Tk, d)`` tensor) and the paged one
(``flash_decode(..., block_table=...)`` on ``(P, h_kv, p, d)`` pools, pages in a random order,
``--page`` tokens each; ``--order sequential``: in the rows' order), the ratio paged / contiguous, and GB/s of the paged step (bytes of K/V
and scales read / time). ``--clock cpu``: CPU seconds per step (all threads) instead, for an
oversubscribed machine.
"""

from __future__ import annotations

import argparse

import torch

from _timing import interleaved
from decode_variants import _cpu_interleaved
from mha.ops.decode import flash_decode, quantize_int8

H, TQ, D = 32, 1, 128


def _pool(x: torch.Tensor, page: int, order: torch.Tensor) -> torch.Tensor:
    """``x (B, h, Tk, d[...])`` -> pool ``(P, h, page, ...)`` with row b's page i at
    ``order[b * M + i]``."""
    B, h, Tk = x.shape[:3]
    M = Tk // page
    tiles = x.reshape(B, h, M, page, *x.shape[3:]).transpose(1, 2)  # (B, M, h, page, ...)
    pool = torch.empty((B * M, h, page, *x.shape[3:]), dtype=x.dtype)
    pool[order] = tiles.reshape(B * M, h, page, *x.shape[3:])  # (P, h, page, ...)
    return pool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--Tk", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--order", choices=["random", "sequential"], default="random",
                    help="pages of the pool in a random order, or in the rows' order")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    B = a.B
    print(f"(B, h, Tq, d) = ({B}, {H}, {TQ}, {D}), page {a.page} ({a.order} order), "
          f"{torch.get_num_threads()} threads, {a.clock} clock")
    print(f"{'Tk':>6} {'K/V':>5} {'contig ms':>10} {'paged ms':>9} {'paged/contig':>12} "
          f"{'GB/s':>6}")
    for Tk in a.Tk:
        M = Tk // a.page
        order = torch.randperm(B * M) if a.order == "random" else torch.arange(B * M)
        bt = torch.empty(B * M, dtype=torch.int32)
        bt[torch.arange(B * M)] = order.to(torch.int32)
        bt = bt.view(B, M)  # (B, M): row b's page i is pool page order[b * M + i]
        q = torch.randn(B, H, TQ, D)  # (B, h, Tq, d)
        k, v = torch.randn(B, H, Tk, D), torch.randn(B, H, Tk, D)  # (B, h, Tk, d)
        fns, nbytes = {}, {}
        for name in ("fp32", "bf16", "int8"):
            if name == "int8":
                (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
                dense = dict(k=kq, v=vq, k_scale=ks, v_scale=vs)
                qq = q
            else:
                dt = torch.float32 if name == "fp32" else torch.bfloat16
                dense = dict(k=k.to(dt), v=v.to(dt))
                qq = q.to(dt)
            paged = {n: _pool(t if t.dim() == 4 else t.unsqueeze(-1), a.page, order)
                     for n, t in dense.items()}
            paged = {n: (t if n in ("k", "v") else t[..., 0]) for n, t in paged.items()}
            nbytes[name] = sum(t.numel() * t.element_size() for t in dense.values())

            def contig(qq=qq, d=dense):
                with torch.no_grad():
                    flash_decode(qq, d["k"], d["v"],
                                 k_scale=d.get("k_scale"), v_scale=d.get("v_scale"))

            def pages(qq=qq, p=paged, bt=bt):
                with torch.no_grad():
                    flash_decode(qq, p["k"], p["v"], k_scale=p.get("k_scale"),
                                 v_scale=p.get("v_scale"), block_table=bt)

            fns[f"{name} contig"], fns[f"{name} paged"] = contig, pages
        t = (_cpu_interleaved(fns, a.rounds, calls=1) if a.clock == "cpu"
             else interleaved(fns, a.rounds, min_time=0.2))
        for name in ("fp32", "bf16", "int8"):
            c, p = t[f"{name} contig"], t[f"{name} paged"]
            print(f"{Tk:>6} {name:>5} {c * 1e3:10.2f} {p * 1e3:9.2f} {p / c:12.3f} "
                  f"{nbytes[name] / p / 1e9:6.2f}")
        del fns


if __name__ == "__main__":
    main()
