"""The seeds' module against ``torch.nn.MultiheadAttention``, and where its time goes.

Shape legend: B batch, T sequence length, d_model model width, h heads, d = d_model / h.

For each shape and dtype: ``nn.MHA`` (eval, no_grad: torch's fast path) and
``mha.MultiHeadAttention`` with the same weights, then the module's pieces timed alone — the
QKV projection ``(B T, d_model) -> (B T, 3 d_model)``, attention on ``(B, h, T, d)`` views, the
head merge + output projection, the merge alone and the merge folded into W_O as one ``einsum``
— and torch's GEMMs vs mha.linear's native tiles on the same
products. One process, calls interleaved round-robin, medians. The line ``forward: ...`` says
whether the module runs fused (bf16 or fp32 inference, :mod:`mha.ops.self_attention`: one
native call) or step by step; where it runs fused, "native forced" is the fused call, "step by
step, native forced" the step-by-step module on mha's tiles and "torch forced" the step-by-step
module on torch's GEMMs (the pieces time the steps alone either way); the module frozen
(``freeze()``: the fused call's weights packed once) is timed beside them. ``--faults`` also
counts the minor page faults per call of nn.MHA, the module and the module on mha's tiles
(``ru_minflt`` over 200 calls).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=src .venv/bin/python \
        benchmarks/probes/module.py --small --dtype bf16 --threads 1 --clock cpu --pieces

``--causal`` also times ``m(x, causal=True)`` as the module runs it (the line ``causal: ...``
says which way) and both calls again with the fused forward switched off in the probe ("step by
step", on the GEMMs the module measured), and prints causal against not causal:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=src .venv/bin/python \
        benchmarks/probes/module.py --causal --shape 32,20,512,8 --shape 8,64,512,8 \
        --threads 1 --clock cpu --rounds 9
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.nn.functional as F

import mha
import mha.module
from _timing import interleaved
from mha.ops import linear, linear_choice
from mha.ops import self_attention as fused

SHAPES = ((32, 20, 512, 8), (8, 512, 1024, 16))  # (B, T, d_model, h)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def pieces(m: mha.MultiHeadAttention, x: torch.Tensor) -> dict:
    """The module's steps, each alone, on the tensors the module makes."""
    B, T, D = x.shape
    h = m.num_heads
    W, b = m.in_proj.weight, m.in_proj.bias
    qkv = F.linear(x, W, b)  # (B, T, d_model) -> (B, T, 3 d_model)
    q, k, v = (t.view(B, T, h, D // h).transpose(1, 2)  # (B, T, h, d) -> (B, h, T, d)
               for t in qkv.split(D, dim=-1))
    out = mha.attention(q, k, v)  # (B, h, T, d)
    w_o = m.out_proj.weight.view(D, h, D // h)  # (d_model, h d) -> (d_model, h, d)
    return {
        "qkv proj": lambda: m.project(x, x, x, True),
        "attention": lambda: mha.attention(q, k, v),
        "merge+out proj": lambda: m._output(out, None, _Off()),
        "merge alone": lambda: m.merge_heads(out),  # (B, h, T, d) -> (B, T, h d)
        # the merge folded into W_O: (B, h, T, d) x (d_model, h, d) -> (B, T, d_model)
        "merge+out proj as einsum": lambda: torch.einsum("bhtd,nhd->btn", out, w_o)
        + m.out_proj.bias,
    }


def faults(fns: dict, calls: int) -> dict:
    """Minor page faults per call of each (``ru_minflt`` of the process over ``calls`` calls,
    after one warm-up call): new memory first touched inside the call."""
    out = {}
    with torch.no_grad():
        for name, fn in fns.items():
            fn()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(calls):
                fn()
            out[name] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
    return out


class _Off:
    on = False

    def record(self, *a, **k):
        pass


def gemms(M: int, N: int, K: int, dtype) -> dict:
    x, w, b = torch.randn(M, K).to(dtype), torch.randn(N, K).to(dtype), torch.randn(N).to(dtype)
    out = {f"F.linear {M}x{N}x{K}": lambda: F.linear(x, w, b)}
    if dtype == torch.float32 and _native_built():
        out[f"native tiles {M}x{N}x{K}"] = lambda: torch.ops.mha.linear(x, w, b)
    if dtype == torch.bfloat16 and _native_built() and linear.bf16_tiles():
        out[f"native bf16 tiles {M}x{N}x{K}"] = lambda: torch.ops.mha.linear_bf16(x, w, b)
    return out


def _native_built() -> bool:
    """Whether the native op is loaded (its portable loops count: they are what runs here)."""
    linear.load()
    try:
        torch.ops.mha.linear_vectorized  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _forcing(side: str, fn):
    """``fn`` with every projection forced to ``side`` (as ``MHA_LINEAR=side``)."""
    def run():
        measured = linear_choice.forced
        linear_choice.forced = lambda: side
        try:
            return fn()
        finally:
            linear_choice.forced = measured
    return run


def _unfused(fn):
    """``fn`` with the fused forward off (the module's gate answers with a reason)."""
    def run():
        gate = mha.module.why_not_fused
        mha.module.why_not_fused = lambda *a: "off in the probe"
        try:
            return fn()
        finally:
            mha.module.why_not_fused = gate
    return run


def case(B: int, T: int, D: int, h: int, dname: str, rounds: int, with_pieces: bool,
         with_causal: bool, clock, with_faults: bool = False) -> None:
    dtype = DTYPES[dname]
    ref = torch.nn.MultiheadAttention(D, h, batch_first=True, dtype=dtype).eval()
    m = mha.MultiHeadAttention.from_torch(ref).to(dtype).eval()
    x = torch.randn(B, T, D).to(dtype)  # (B, T, d_model)
    fns = {"nn.MHA": lambda: ref(x, x, x, need_weights=False), "mha module": lambda: m(x)}
    if _native_built():
        for side in ("torch", "native"):
            fns[f"module, {side} forced"] = _forcing(side, lambda: m(x))
        if T <= fused.MAX_T:
            fns["module step by step, native forced"] = _forcing("native", _unfused(lambda: m(x)))
    if fused.tiles(dtype) is None:  # freeze(): the weights packed once
        frozen = mha.MultiHeadAttention.from_torch(ref).to(dtype).eval().freeze()
        fns["module frozen"] = lambda: frozen(x)
    if with_causal:
        fns.update({"module step by step": _unfused(lambda: m(x)),
                    "module causal": lambda: m(x, causal=True),
                    "module causal, step by step": _unfused(lambda: m(x, causal=True))})
    if with_pieces:
        fns.update(pieces(m, x))
        fns.update(gemms(B * T, 3 * D, D, dtype))
        fns.update(gemms(B * T, D, D, dtype))
    with torch.no_grad():
        t = interleaved(fns, rounds, min_time=0.05, clock=clock)
        forward = m.explain(x).splitlines()[-1]
        causal = m.explain(x, causal=True).splitlines()[-1] if with_causal else None
    base = t["nn.MHA"]
    print(f"B{B} T{T} d_model{D} h{h} {dname}: nn.MHA {base * 1e3:.3f} ms, "
          f"mha {t['mha module'] * 1e3:.3f} ms = {base / t['mha module']:.2f}x")
    print(f"    {forward}")
    if with_causal:
        print(f"    causal {causal}")
    for w, width in (("QKV", 3 * D), ("out", D)):
        weight = torch.empty(width, D, dtype=dtype)
        print(f"    {w} projection: {mha.linear.describe(x, weight, None)}")
    for name, sec in t.items():
        if "forced" in name or name == "module frozen" or name.startswith("module causal"):
            print(f"    {name}: {sec * 1e3:.3f} ms = {base / sec:.2f}x nn.MHA")
        elif name not in ("nn.MHA", "mha module"):
            print(f"    {name:28s} {sec * 1e3:8.3f} ms ({sec / t['mha module']:5.1%} of the module)")
    if with_faults:
        per_call = faults({name: fns[name] for name in ("nn.MHA", "mha module",
                                                        "module, native forced") if name in fns},
                          200)
        print("    page faults per call (ru_minflt over 200 calls): "
              + ", ".join(f"{name} {n:.1f}" for name, n in per_call.items()))
    if with_causal:
        print(f"    causal / not causal {t['module causal'] / t['mha module']:.3f}; causal step "
              f"by step / causal {t['module causal, step by step'] / t['module causal']:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--pieces", action="store_true", help="also time the module's steps")
    ap.add_argument("--dtype", choices=tuple(DTYPES), action="append",
                    help="only these dtypes (default: all)")
    ap.add_argument("--small", action="store_true", help="only the seeds' shape")
    ap.add_argument("--faults", action="store_true",
                    help="also count page faults per call of nn.MHA and the module (ru_minflt)")
    ap.add_argument("--causal", action="store_true",
                    help="also time causal=True, and both calls with the fused forward off")
    ap.add_argument("--shape", action="append", metavar="B,T,D,h",
                    help="these shapes instead (batch, length, d_model, heads); repeatable")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch's intra-op threads (default: torch's own); 1 keeps a loaded "
                         "machine's descheduled second thread out of the times")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the calling thread's CPU time (time.thread_time; needs --threads 1)")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu times the calling thread only: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, clock {args.clock}, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    torch.manual_seed(0)
    shapes = ([tuple(int(v) for v in sh.split(",")) for sh in args.shape] if args.shape
              else SHAPES[:1] if args.small else SHAPES)
    for B, T, D, h in shapes:
        for dname in args.dtype or DTYPES:
            case(B, T, D, h, dname, args.rounds, args.pieces, args.causal, clock, args.faults)
    print(f"load average after {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
