"""The per-call cost of ``mha.attention`` at small shapes, against its op, its kernel and SDPA.

Shape legend: B batch, h query heads, h_kv K/V heads, Tq / Tk lengths, d head dim.
Microseconds per call, in one process, round-robin (every contender runs one batch of
``--calls`` calls per round, so a busy neighbour slows them alike), the fastest batch of
``--rounds``, on the calling thread's CPU clock (``time.thread_time``: descheduling on a shared
machine is not counted). Forward calls only; "grad" means q, k, v require grad (autograd
records the call). Columns:

* ``auto`` — ``mha.attention(q, k, v, ...)``, dispatch choosing (its pick in brackets);
* ``forced`` — ``mha.attention(..., backend=--backend)``;
* ``op`` — ``mha.ops.flash.flash_attention`` (the native op's Python function: no validation,
  no dispatch);
* ``torch.ops`` — the registered op ``torch.ops.mha.flash_attention_fwd`` called as torch.compile
  calls it (through the Python Autograd kernel of ``register_autograd``);
* ``kernel`` — the op's CPU kernel called below the Autograd key (no autograd, no Python);
* ``decode op`` — ``mha.ops.decode.call_op``, flash_decode's op (what ``auto`` runs for
  Tq <= 16 without grad; inference only, so not timed with grad);
* ``sdpa`` — ``torch.nn.functional.scaled_dot_product_attention``.

``--stages`` adds where ``forced`` spends its time: validation (``make_call``), dispatch
(``dispatch.choose``) and the backend (``Backend.forward``), each timed alone on a prepared
call::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python \\
        benchmarks/probes/call_overhead.py --threads 1 --rounds 5 --calls 3000 --stages
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

import mha
from _timing import interleaved
from mha import backends, dispatch
from mha.functional import make_call
from mha.ops import decode, flash

# (name, q shape, k/v shape, causal): the seeds' small problem and a decode-like step (GQA)
CASES = (("dense", (2, 8, 16, 64), (2, 8, 16, 64), False),
         ("causal", (2, 8, 16, 64), (2, 8, 16, 64), True),
         ("decode", (1, 9, 1, 64), (1, 3, 256, 64), False))


def _kernel(q, k, v, causal: bool, below_autograd: bool):
    args = (q, k, v, None, None, causal, q.shape[-1] ** -0.5, 0, 0.0, None, None, None, None,
            None)
    op = torch.ops.mha.flash_attention_fwd

    def run():
        with torch._C._AutoDispatchBelowAutograd():
            return op.default(*args)
    return run if below_autograd else (lambda: op(*args))


def _contenders(q, k, v, causal: bool, backend: str) -> dict:
    gqa = k.shape[1] != q.shape[1]
    fns = {
        "auto": lambda: mha.attention(q, k, v, causal=causal),
        "forced": lambda: mha.attention(q, k, v, causal=causal, backend=backend),
        "op": lambda: flash.flash_attention(q, k, v, causal=causal),
        "torch.ops": _kernel(q, k, v, causal, below_autograd=False),
        "kernel": _kernel(q, k, v, causal, below_autograd=True),
        "decode op": lambda: decode.call_op(q, k, v, key_lengths=None, mask=None, causal=causal,
                                            scale=q.shape[-1] ** -0.5),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
    }
    if q.requires_grad:
        del fns["decode op"]
    return fns


def _stages(q, k, v, causal: bool, backend: str) -> dict:
    call = make_call(q, k, v, causal=causal)
    b = backends.get(backend)
    return {
        "make_call": lambda: make_call(q, k, v, causal=causal),
        "choose auto": lambda: dispatch.choose(call),
        "choose forced": lambda: dispatch.choose(call, backend),
        "backend": lambda: b.forward(call),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3000, help="calls per batch")
    ap.add_argument("--backend", default="flash_cpu", help="the forced column's backend")
    ap.add_argument("--stages", action="store_true", help="also time forced's stages")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert flash.unavailable() is None, flash.unavailable()
    assert decode.unavailable() is None, decode.unavailable()
    flash.load_backward()
    load = os.getloadavg()[0]
    print(f"threads {torch.get_num_threads()}, load average {load:.2f}, microseconds per call "
          f"(fastest of {args.rounds} batches of {args.calls}, thread CPU time)")
    names = ("auto", "forced", "op", "torch.ops", "kernel", "decode op", "sdpa")
    print(f"{'case':<22} " + " ".join(f"{n:>9}" for n in names)
          + f"  {'auto/sdpa':>9} {'forced/sdpa':>11}  auto's pick")
    staged = []
    for name, qs, kvs, causal in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            for grad in (False, True):
                if name == "decode" and grad:
                    continue  # a decoding step is inference
                g = torch.Generator().manual_seed(0)
                q = torch.randn(qs, generator=g).to(dtype).requires_grad_(grad)
                k, v = (torch.randn(kvs, generator=g).to(dtype).requires_grad_(grad)
                        for _ in range(2))
                fns = _contenders(q, k, v, causal, args.backend)
                secs = interleaved(fns, args.rounds, warmup=200, inner=args.calls, stat=min,
                                   clock=time.thread_time)
                t = {n: s * 1e6 for n, s in secs.items()}
                pick = mha.explain(q, k, v, causal=causal).chosen
                label = f"{name} {str(dtype)[6:]}{' grad' if grad else ''}"
                print(f"{label:<22} " + " ".join(f"{t[n]:9.1f}" if n in t else f"{'-':>9}"
                                                  for n in names)
                      + f"  {t['auto'] / t['sdpa']:9.2f} {t['forced'] / t['sdpa']:11.2f}  {pick}")
                if args.stages:
                    st = interleaved(_stages(q, k, v, causal, args.backend), args.rounds,
                                     warmup=200, inner=args.calls, stat=min,
                                     clock=time.thread_time)
                    staged.append((label, {n: s * 1e6 for n, s in st.items()}))
    if staged:
        print(f"\nstages of forced (backend={args.backend}), microseconds per call")
        cols = tuple(staged[0][1])
        print(f"{'case':<22} " + " ".join(f"{c:>13}" for c in cols))
        for label, st in staged:
            print(f"{label:<22} " + " ".join(f"{st[c]:13.2f}" for c in cols))


if __name__ == "__main__":
    main()
