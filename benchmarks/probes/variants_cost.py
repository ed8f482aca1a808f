"""What each score variant costs in the native kernel: flash_cpu with softcap / sinks / ALiBi /
a T5-style bias against flash_cpu plain, forward or forward + backward.

Run (one shape and dtype per command):
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/probes/variants_cost.py \
        --T 2048 --dtype float32 [--train]

Shape (1, 8, T, 64), causal. Prints the median ms of each, measured side by side in one process
(round-robin), and each one's ratio to plain flash_cpu; the SDPA rows take the variant as a
materialized float mask (bias + causal -inf), the way a user without mha would run it. Every
output is checked against the float64 reference first (one head, max error printed).
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

import mha
from _timing import interleaved
from mha.masks import causal_mask


def _backward(f) -> None:
    """One forward + backward of the timed call ``f``."""
    f().sum().backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--train", action="store_true", help="forward + backward")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    dtype, T, h = getattr(torch, a.dtype), a.T, 8
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, T, 64).to(dtype).requires_grad_(a.train) for _ in range(3))
    slopes = mha.alibi_slopes(h)  # (h,)
    bias = (torch.randn(1, h, T, T) * 0.5).to(dtype).requires_grad_(a.train)  # T5-style
    sinks = torch.randn(h).requires_grad_(a.train)
    allowed = causal_mask(T, T)  # (T, T)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    alibi = -(slopes.view(h, 1, 1) * (i - j).float())[None]  # (1, h, T, T)
    minus_inf = torch.zeros(T, T).masked_fill(~allowed, float("-inf"))  # (T, T)
    variants = {"plain": {}, "softcap 50": dict(softcap=50.0), "sinks": dict(sinks=sinks),
                "alibi": dict(alibi_slopes=slopes), "t5 bias": dict(bias=bias)}
    fns = {f"flash_cpu {n}": functools.partial(mha.attention, q, k, v, causal=True,
                                               backend="flash_cpu", **kw)
           for n, kw in variants.items()}
    fns["sdpa alibi mask"] = functools.partial(F.scaled_dot_product_attention, q, k, v,
                                               attn_mask=(alibi + minus_inf).to(dtype))
    fns["sdpa t5 bias mask"] = lambda: F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias + minus_inf.to(dtype))
    for n, kw in variants.items():  # one head of each against the float64 loop
        ref = mha.attention(*(t[:, :1].detach().double() for t in (q, k, v)), causal=True,
                            backend="reference",
                            **{m: (x[:1] if m == "sinks" else x[:, :1] if m == "bias" else
                                   x[:1] if m == "alibi_slopes" else x).detach().double()
                               if torch.is_tensor(x) else x for m, x in kw.items()})
        got = fns[f"flash_cpu {n}"]()[:, :1].detach().double()
        print(f"  check {n:<12} max |flash_cpu - float64| = {(got - ref).abs().max().item():.1e}")
    if a.train:
        fns = {n: functools.partial(_backward, f) for n, f in fns.items()}
    ctx = torch.enable_grad() if a.train else torch.no_grad()
    with ctx:
        ms = {n: t * 1e3 for n, t in interleaved(fns, a.rounds).items()}
    base = ms["flash_cpu plain"]
    print(f"(1, {h}, {T}, 64) {a.dtype} causal {'fwd+bwd' if a.train else 'forward'}; "
          f"threads {torch.get_num_threads()}")
    for name, t in ms.items():
        print(f"  {name:<20} {t:9.1f} ms  {t / base:6.2f}x")


if __name__ == "__main__":
    main()
