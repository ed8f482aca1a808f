"""mask_mod calls: the native plan walk (flash_cpu) against the PyTorch-ops walk (blocksparse) and
SDPA with the materialized bool mask (developer probe).

Run (one process, round-robin medians; unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE):
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/probes/plan_walk.py \
        --T 4096 --dtypes fp32 bf16 --modes fwd train

Shape (1, h, T, d), Tq = Tk = T. Rows: ``document n`` (``mha.mods.document`` over the ``mha
bench --suite variants`` seeded uneven lengths, bidirectional), ``prefix-lm T/4``, ``sliding
window 512``. Columns: median ms of ``flash_cpu`` (forced), ``blocksparse`` (forced) and
``torch.nn.functional.scaled_dot_product_attention`` with the (T, T) bool mask; the ratios
blocksparse / flash_cpu and sdpa / flash_cpu (> 1: the native walk is faster); the native time
per kept pair relative to the ``document 2`` row (1.00 = cost proportional to sum len_i^2);
the max |flash_cpu - sdpa| of the outputs (checked before timing). Plans are built once
(cached, as across a model's layers); the build time of the 48 x 128 plan is printed per row.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F

import mha
from _timing import interleaved
from mha import mods
from mha.bench.variants import doc_lengths
from mha.ops import flash


def step(fn, train: bool):
    """``fn`` as one timed step: its output, and in training the backward of its sum."""
    def run():
        out = fn()
        if train:
            out.float().sum().backward()
        return out
    return run


def rows(T: int) -> list[tuple[str, object]]:
    out = []
    for n in (2, 4, 8, 16):
        lengths = doc_lengths(T, n)
        cu = [0] + [sum(lengths[:i + 1]) for i in range(n)]
        out.append((f"document {n}", mods.document(cu_seqlens=cu)))
    out.append(("prefix-lm T/4", mods.prefix_lm(T // 4)))
    out.append(("sliding window 512", mods.sliding_window(512)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--h", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--modes", nargs="+", default=["fwd", "train"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--impls", nargs="+", default=["flash_cpu", "blocksparse", "sdpa"],
                    help="a subset (blocksparse in bf16 takes ~100 s a call at T = 4096 on AVX2)")
    ap.add_argument("--scaling", action="store_true",
                    help="only flash_cpu on the document rows, all interleaved in one timing "
                         "loop: the time per kept pair across rows, free of load drift")
    a = ap.parse_args()
    T, h, d = a.T, a.h, a.d
    print(f"threads {torch.get_num_threads()}, (1, {h}, {T}, {d}), torch {torch.__version__}, "
          f"flash kernels {flash.kernels()}")
    if a.scaling:
        return scaling(a)
    print(f"{'mode':<5} {'dtype':<5} {'row':<19} {'flash_cpu':>10} {'blocksparse':>12} "
          f"{'sdpa mask':>10} {'bs/native':>9} {'sdpa/nat':>9} {'per pair':>8} {'err':>8}")
    for mode in a.modes:
        train = mode == "train"
        for dt in a.dtypes:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt]
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, h, T, d, generator=g).to(dtype).requires_grad_(train)
                       for _ in range(3))
            per_pair0 = None
            for name, mod in rows(T):
                t0 = time.perf_counter()
                plan = mha.block_plan(mod, 1, h, T, T, block_q=48, block_k=128)
                build = (time.perf_counter() - t0) * 1e3
                dense = plan.materialize()[0, 0]  # (T, T) bool, for sdpa only
                kept = int(dense.sum())

                fns = {
                    "flash_cpu": step(partial(mha.attention, q, k, v, mask_mod=mod,
                                              backend="flash_cpu"), train),
                    "blocksparse": step(partial(mha.attention, q, k, v, mask_mod=mod,
                                                backend="blocksparse"), train),
                    "sdpa": step(partial(F.scaled_dot_product_attention, q, k, v,
                                         attn_mask=dense), train),
                }
                fns = {n: f for n, f in fns.items() if n in a.impls or n == "flash_cpu"}
                with torch.set_grad_enabled(train):
                    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
                    err = (fns["flash_cpu"]().float() - ref.float()).abs().max().item()
                    ms = {n: s * 1e3 for n, s in interleaved(fns, a.rounds).items()}
                for t in (q, k, v):
                    t.grad = None
                per_pair = ms["flash_cpu"] / kept
                per_pair0 = per_pair0 or per_pair
                nan = float("nan")
                bs, sd = ms.get("blocksparse", nan), ms.get("sdpa", nan)
                print(f"{mode:<5} {dt:<5} {name:<19} {ms['flash_cpu']:>10.1f} "
                      f"{bs:>12.1f} {sd:>10.1f} {bs / ms['flash_cpu']:>9.2f} "
                      f"{sd / ms['flash_cpu']:>9.2f} {per_pair / per_pair0:>8.2f} "
                      f"{err:>8.1e}   ({kept / T / T:.3f} of pairs kept; plan built in "
                      f"{build:.0f} ms: {plan})", flush=True)


def scaling(a) -> None:
    """flash_cpu on document 2 / 4 / 8 / 16, interleaved: ms and ms per kept pair relative to
    the 2-document row (1.00 = proportional to sum len_i^2)."""
    T, h, d = a.T, a.h, a.d
    for mode in a.modes:
        train = mode == "train"
        for dt in a.dtypes:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt]
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, h, T, d, generator=g).to(dtype).requires_grad_(train)
                       for _ in range(3))
            fns, kept = {}, {}
            for name, mod in rows(T)[:4]:
                plan = mha.block_plan(mod, 1, h, T, T, block_q=48, block_k=128)
                kept[name] = int(plan.materialize().sum())

                fns[name] = step(partial(mha.attention, q, k, v, mask_mod=mod,
                                         backend="flash_cpu"), train)
            with torch.set_grad_enabled(train):
                ms = {n: s * 1e3 for n, s in interleaved(fns, a.rounds).items()}
            base = ms["document 2"] / kept["document 2"]
            print(f"{mode} {dt}: " + ", ".join(
                f"{n} {ms[n]:.0f} ms (sum len^2 {kept[n] / T / T:.3f} T^2, per pair "
                f"{ms[n] / kept[n] / base:.2f})" for n in fns), flush=True)


if __name__ == "__main__":
    main()
