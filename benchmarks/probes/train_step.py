"""Training-step timing: forward + backward of mha.attention vs torch SDPA, side by side.

Shape legend: B batch, h heads, T sequence length (Tq = Tk), d head dim.
One step = ``out = attention(q, k, v); out.backward(grad)`` with q, k, v requiring grad.
Contenders: ``sdpa`` (torch.nn.functional.scaled_dot_product_attention), ``mha``
(mha.attention: the flash_cpu forward and the fused native backward) and, with ``--torch-bwd``,
``mha-torchbwd`` (the same forward with the PyTorch chunked backward, the fallback).
Medians of ``--repeats`` round-robin timed runs after a warm-up, in one process; read the
ratio columns (SDPA time / mha time: above 1 means mha is faster).

    flock -x /tmp/mha-bench.lock env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \\
        .venv/bin/python benchmarks/probes/train_step.py --torch-bwd
    .venv/bin/python benchmarks/probes/train_step.py --cases 1,8,2048,64,fp32,causal
    .venv/bin/python benchmarks/probes/train_step.py --threads 1 --clock cpu --cases 32,8,20,64,fp32,dense
    .venv/bin/python benchmarks/probes/train_step.py --backward-only --cases 4,8,512,64,fp32,causal
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.nn.functional as F

import mha
from _timing import interleaved
from mha.ops import flash

# (B, h, T, d, dtype, mask)
CASES = ("1,8,2048,64,fp32,causal", "1,8,2048,64,bf16,causal", "4,8,512,64,fp32,causal",
         "32,8,20,64,fp32,dense", "1,8,4096,64,fp32,dense")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _step(attn, q, k, v, grad, causal):
    def run():
        for t in (q, k, v):
            t.grad = None
        attn(q, k, v, causal).backward(grad)
    return run


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _mha(q, k, v, causal):
    return mha.attention(q, k, v, causal=causal)


def contenders(case: str, torch_bwd: bool) -> dict:
    B, h, T, d, dt, kind = case.split(",")
    B, h, T, d = int(B), int(h), int(T), int(d)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, T, d, generator=g).to(DTYPES[dt]).requires_grad_()
               for _ in range(3))  # (B, h, T, d) each
    grad = torch.randn(B, h, T, d, generator=g).to(DTYPES[dt])  # (B, h, T, d)
    causal = kind == "causal"
    runs = {"sdpa": _step(_sdpa, q, k, v, grad, causal), "mha": _step(_mha, q, k, v, grad, causal)}
    if torch_bwd:
        fused = _step(_mha, q, k, v, grad, causal)

        def torch_backward():
            saved = flash.load_backward
            flash.load_backward = lambda: "benchmark: PyTorch backward"
            try:
                fused()
            finally:
                flash.load_backward = saved
        runs["mha-torchbwd"] = torch_backward
    return runs


def backward_only(case: str, repeats: int) -> dict[str, float]:
    """The backward op alone: the fused kernel vs the PyTorch fallback at two chunk sizes."""
    B, h, T, d, dt, kind = case.split(",")
    B, h, T, d = int(B), int(h), int(T), int(d)
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(B, h, T, d, generator=g).to(DTYPES[dt]) for _ in range(4))
    causal = kind == "causal"
    out, lse = flash.flash_attention(q, k, v, causal=causal)  # (B, h, T, d), (B, h, T)
    args = (go, None, q, k, v, out, lse, None, None, causal, d ** -0.5)

    def torch_chunks(n):
        def run():
            saved = flash._CHUNK_ELEMENTS
            flash._CHUNK_ELEMENTS = n
            try:
                flash.flash_attention_bwd_torch(*args)
            finally:
                flash._CHUNK_ELEMENTS = saved
        return run

    return interleaved({"fused": lambda: torch.ops.mha.flash_attention_bwd_fused(*args),
                  "torch 2^20": torch_chunks(1 << 20), "torch 2^23": torch_chunks(1 << 23)},
                 repeats)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), help="B,h,T,d,fp32|bf16,causal|dense")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the calling thread's CPU time (with --threads 1, for a shared machine)")
    ap.add_argument("--torch-bwd", action="store_true", help="also time the PyTorch backward")
    ap.add_argument("--backward-only", action="store_true",
                    help="time the backward op alone: fused vs PyTorch (chunks 2^20 and 2^23)")
    ap.add_argument("--faults", action="store_true",
                    help="also count each step's minor page faults (ru_minflt over 50 steps)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    assert flash.unavailable() is None, flash.unavailable()
    flash.load_backward()
    if args.backward_only:
        print(f"threads {torch.get_num_threads()}; ms per backward (median of {args.repeats})")
        for case in args.cases:
            t = backward_only(case, args.repeats)
            cols = "  ".join(f"{name} {1e3 * s:8.2f}" for name, s in t.items())
            print(f"{case:28s} {cols}   torch 2^20 / fused {t['torch 2^20'] / t['fused']:5.2f}x",
                  flush=True)
        return
    print(f"threads {torch.get_num_threads()}; ms per fwd+bwd step (median of {args.repeats}, "
          f"{args.clock} clock)")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    for case in args.cases:
        t = interleaved(contenders(case, args.torch_bwd), args.repeats, min_time=0.2, clock=clock)
        cols = "  ".join(f"{name} {1e3 * s:8.2f}" for name, s in t.items())
        ratios = "  ".join(f"sdpa/{name} {t['sdpa'] / s:5.2f}x" for name, s in t.items()
                           if name != "sdpa")
        print(f"{case:28s} {cols}   {ratios}", flush=True)
        if args.faults:
            print(f"{'':28s} page faults per step: " + "  ".join(
                f"{name} {n:.0f}" for name, n in faults(contenders(case, False)).items()))


def faults(fns: dict, steps: int = 50) -> dict[str, float]:
    """Minor page faults per call of each function (after one warm-up call): the first
    touches of memory the allocator took back from the kernel since the last call."""
    out = {}
    for name, fn in fns.items():
        fn()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(steps):
            fn()
        out[name] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps
    return out


if __name__ == "__main__":
    main()
