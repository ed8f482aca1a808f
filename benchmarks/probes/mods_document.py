"""Document masks through a block plan: cost follows sum(len_i^2), not T^2 (developer probe).

Run (small; one process, round-robin, under the timing lock):
    .venv/bin/python benchmarks/probes/mods_document.py --T 2048 4096 --doc 256

Shape (1, 8, T, 64) float32, causal documents of ``--doc`` tokens each. Prints the median ms of
each, measured side by side in one process, and each one's ratio to the plan path:
  * mha mask_mod      mha.attention(mask_mod=and_masks(document(cu), causal())): the
                      blocksparse backend, plan cached (built once, as across layers);
  * mha dense mask    mha.attention(mask=dense) with the materialized (T, T) bool mask (mha's
                      pick for a dense mask);
  * mha math mask     the same forced to the math backend (PyTorch ops, all T^2 scores);
  * torch sdpa mask   F.scaled_dot_product_attention with the materialized bool mask.
The plan's build time is printed on its own (once per mask, cached afterwards).
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F

import mha
from _timing import interleaved
from mha import mods


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--doc", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    print(f"threads {torch.get_num_threads()}, documents of {a.doc} tokens, causal, "
          f"(1, 8, T, 64) float32")
    for T in a.T:
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 8, T, 64) for _ in range(3))  # (B, h, T, d)
        cu = torch.arange(0, T + 1, a.doc).clamp(max=T).unique()
        mod = mods.and_masks(mods.document(cu_seqlens=cu), mods.causal())
        t0 = time.perf_counter()
        plan = mha.block_plan(mod, 1, 8, T, T)
        build_ms = (time.perf_counter() - t0) * 1e3
        dense = plan.materialize()  # (1, 1, T, T)
        fns = {
            "mha mask_mod": functools.partial(mha.attention, q, k, v, mask_mod=mod),
            "mha dense mask": functools.partial(mha.attention, q, k, v, mask=dense),
            "mha math mask": functools.partial(mha.attention, q, k, v, mask=dense,
                                               backend="math"),
            "torch sdpa mask": functools.partial(F.scaled_dot_product_attention, q, k, v,
                                                 attn_mask=dense),
        }
        with torch.no_grad():
            err = (fns["mha mask_mod"]() - fns["torch sdpa mask"]()).abs().max().item()
            ms = {n: s * 1e3 for n, s in interleaved(fns, a.rounds).items()}
        base = ms["mha mask_mod"]
        print(f"T={T}: {plan}; plan built in {build_ms:.0f} ms; mha picks "
              f"{mha.explain(q, k, v, mask=dense).chosen} for the dense mask; "
              f"max |mask_mod - sdpa| = {err:.1e}")
        for name, t in ms.items():
            print(f"  {name:<16} {t:9.1f} ms  {t / base:6.2f}x")


if __name__ == "__main__":
    main()
