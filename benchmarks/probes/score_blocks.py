"""The accuracy rule at large d_k: random fp32 cases drawn as tests/test_flash_cpu.py's
test_accuracy_vs_fp64 draws them, d_k fixed, on each forward kernel that serves fp32.

For each kernel: the largest error / budget (budget = 2 x the naive fp32 reference's error + 1e-6,
the test's) and how many cases exceed 1, with the worst case's draw. "auto" is the op's own
choice (the small path when Tk <= 64). docs/kernel.md, "Scores of d_k > 128".

    .venv/bin/python benchmarks/probes/score_blocks.py --draws 2000 --d-k 256

Draw: (B, h_kv, group, Tq, Tk, d_v, causal, lengths, mask, layout, seed).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from kernel_inputs import bool_mask, key_lengths, qkv  # noqa: E402
from mha import reference  # noqa: E402
from mha.masks import MaskSpec  # noqa: E402
from mha.ops import flash  # noqa: E402


def _ref(q, k, v, causal, kl, m, scale, upcast):
    B, h, Tq, _ = q.shape
    allowed = MaskSpec(causal, kl, m).materialize(B, h, Tq, k.shape[2])
    return reference.attention(q, k, v, allowed=allowed, scale=scale, upcast=upcast)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=2000)
    ap.add_argument("--d-k", type=int, default=256)
    ap.add_argument("--seed", type=int, default=12345)
    args = ap.parse_args()
    isa = flash.isa().split(",")
    tiles = [k for k in ("portable", "avx512f") if k in isa]
    rng = random.Random(args.seed)
    worst: dict[str, tuple[float, tuple]] = {}
    over: dict[str, int] = {}
    for _ in range(args.draws):
        draw = (rng.randint(1, 2), rng.randint(1, 2), rng.choice([1, 2, 4]), rng.randint(1, 70),
                rng.randint(1, 90), rng.choice([16, 24, 64, 100, 128]), rng.random() < 0.5,
                rng.random() < 0.5, rng.choice([None, "full", "rows", "keys"]),
                rng.choice(["bthd", "contiguous", "strided"]), rng.randint(0, 99))
        B, h_kv, group, Tq, Tk, d_v, causal, lengths, mask, layout, seed = draw
        h = h_kv * group
        q, k, v = qkv(B, h, h_kv, Tq, Tk, args.d_k, d_v, torch.float32, layout, seed)
        kl = key_lengths(B, Tk, seed, lengths)
        m = bool_mask(mask, B, h, Tq, Tk, seed)
        scale = args.d_k ** -0.5
        exact = _ref(q, k, v, causal, kl, m, scale, True).double()  # (B, h, Tq, d_v)
        naive = _ref(q, k, v, causal, kl, m, scale, False).double()
        budget = 2 * (naive - exact).abs().max().item() + 1e-6
        outs = {"auto": flash.flash_attention(q, k, v, causal=causal, key_lengths=kl, mask=m,
                                              scale=scale)[0]}
        for kern in tiles + (["small"] if "avx512f" in isa and Tk <= 64 else []):
            outs[kern] = torch.ops.mha._flash_attention_fwd_kernel(q, k, v, kl, m, causal, scale,
                                                                   kern)[0]
        for kern, out in outs.items():
            ratio = (out.double() - exact).abs().max().item() / budget
            if ratio > worst.get(kern, (0.0,))[0]:
                worst[kern] = (ratio, draw)
            over[kern] = over.get(kern, 0) + (ratio > 1)
    print(f"{args.draws} draws, d_k={args.d_k} fp32, kernel ISA {flash.isa()}")
    for kern, (ratio, draw) in worst.items():
        print(f"  {kern:9s} max err/budget {ratio:.3f}  over budget {over[kern]}  worst {draw}")


if __name__ == "__main__":
    main()
