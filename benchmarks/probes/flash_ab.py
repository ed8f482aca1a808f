"""A/B timing of flash forward builds in one process: each variant is flash/flash_attn.cpp from
its own source tree (and/or with its own -D flags), loaded side by side and timed round-robin.

Each variant's library is compiled with ``-Dmha=mha_ab_<name>``, so its ops register under
``torch.ops.mha_ab_<name>`` and several builds coexist in one process (the package's own
``torch.ops.mha`` is not loaded). The forward runs through ``_flash_attention_fwd_kernel`` with
the named kernel (default ``auto``). Shape legend: B batch, h heads, T length (Tq = Tk), d
head dim; GFLOP/s counts 4 B h Tq Tk d (half for causal), and the ratio column is each
variant's time over the first variant's (< 1: faster). Builds are cached under
``$MHA_BUILD_DIR/flash_ab`` by sources and flags.

    git -C . archive HEAD src/mha/csrc | tar -x -C /tmp/base   # the old tree
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/probes/flash_ab.py \\
        --variant old=/tmp/base/src/mha/csrc --variant new=src/mha/csrc \\
        --shapes 4,16,2048,64,causal 1,8,4096,64,dense --repeats 7
    # a compile-time switch of one tree: --variant x=src/mha/csrc:-DMHA_SOMETHING=1
    # each call 4 s after the last, 1 GiB held over it (outputs on pages freed long ago):
    ... flash_ab.py --variant old=... --variant new=... --idle 4 --hold 1024 --threads 1 --clock cpu
    # the fused backward instead (flash/flash_attn_bwd.cpp; out and lse from the package's
    # forward, grad_out contiguous; GFLOP/s counts its five products, 10 B h Tq Tk d):
    ... flash_ab.py --backward --dtype bf16 --variant old=... --variant new=src/mha/csrc
    # a training step's two native calls: the package's forward, then each variant's backward
    # (GFLOP/s counts 14 B h Tq Tk d):
    ... flash_ab.py --backward --train --variant old=... --variant new=src/mha/csrc
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import add_variant_argument, build_variant, variants  # noqa: E402
from bench_path import touched  # noqa: E402


def _interleaved(fns: dict, rounds: int, min_time: float, clock, idle: float = 0.0,
                 hold: int = 0) -> dict[str, float]:
    """Median seconds per call of each function, timed round-robin with ``clock``. With
    ``idle``, each sample is one call made ``idle`` seconds after an untimed one, with ``hold``
    MiB written and held over it (so its output gets pages freed that long ago)."""
    inner = {}
    for name, fn in fns.items():
        fn()  # warm-up
        t0 = clock()
        fn()
        inner[name] = 1 if idle else max(1, int(min_time / max(clock() - t0, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            held = None
            if idle:
                fn()
                time.sleep(idle)
                held = touched(hold << 20) if hold else None
            t0 = clock()
            for _ in range(inner[name]):
                fn()
            samples[name].append((clock() - t0) / inner[name])
            del held
    return {name: statistics.median(v) for name, v in samples.items()}


def _build(name: str, csrc: Path, defines: list[str], source: str) -> None:
    """Compile ``source`` (flash/flash_attn.cpp or flash/flash_attn_bwd.cpp) of ``csrc`` with
    ops under mha_ab_<name>, and load it."""
    build_variant(name, csrc, defines, source, "flash_ab")


def build_variants(specs: list[str], source: str) -> list[str]:
    """Build and load ``source`` of each ``--variant`` spec (:func:`_timing.variants`,
    :func:`_build`); their names, in order."""
    parsed = variants(specs)
    for name, csrc, defines in parsed:
        _build(name, csrc, defines, source)
    return [name for name, _, _ in parsed]


def _hand_in(names: list[str], backward: bool) -> None:
    """The bf16 kernel measured on this machine (``mha.ops.flash.bf16_choice``), handed to each
    variant that takes one (trees with the setter op; older trees chose by their own rule), as
    the package hands it to its own extensions: a variant given none widens bf16 to fp32."""
    from mha.ops import flash, flash_choice

    choice = flash.bf16_choice() if flash.unavailable() is None else None
    if not isinstance(choice, flash_choice.Measured):
        return
    setter = "_flash_bwd_set_bf16_choice" if backward else "_flash_set_bf16_choice"
    for n in names:
        try:
            op = getattr(getattr(torch.ops, f"mha_ab_{n}"), setter)
        except (AttributeError, RuntimeError):  # a tree from before the measured choice
            continue
        op(choice.choice)
    print(f"bf16 choice handed in: {choice.choice}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_variant_argument(ap)
    ap.add_argument("--shapes", nargs="+", default=["4,16,2048,64,causal", "1,8,4096,64,dense"],
                    help="B,h,T,d,{dense|causal}")
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--min-time", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the calling thread's CPU time (with --threads 1 the kernel runs on "
                         "it), so time lost to other processes on a shared machine is not counted")
    ap.add_argument("--idle", type=float, default=0.0,
                    help="each sample: one call this many seconds after an untimed one (its "
                         "output on pages freed that long ago; see bench_path.py)")
    ap.add_argument("--hold", type=int, default=0,
                    help="--idle: MiB written after the sleep and held over the timed call")
    ap.add_argument("--check", action="store_true", help="print max |difference| to the first")
    ap.add_argument("--backward", action="store_true",
                    help="time the fused backward (flash/flash_attn_bwd.cpp) instead")
    ap.add_argument("--train", action="store_true",
                    help="with --backward: time the package's forward, then the variant's backward")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = build_variants(args.variant, "flash/flash_attn_bwd.cpp" if args.backward
                           else "flash/flash_attn.cpp")
    if args.dtype == "bf16":
        _hand_in(names, args.backward)
    print(f"threads={torch.get_num_threads()} clock={args.clock} load={os.getloadavg()[0]:.2f}")
    for spec in args.shapes:
        B, h, T, d, mode = spec.split(",")
        B, h, T, d = int(B), int(h), int(T), int(d)
        causal = mode == "causal"
        g = torch.Generator().manual_seed(0)
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        q, k, v, go = (torch.randn(B, h, T, d, generator=g).to(dtype) for _ in range(4))
        scale = d ** -0.5
        if args.backward:
            from mha.ops import flash
            out, lse = flash.flash_attention(q, k, v, causal=causal, scale=scale)

            def call(n, q=q, k=k, v=v, go=go, out=out, lse=lse, causal=causal, scale=scale):
                if args.train:  # the step's forward, then the backward of its out and lse
                    out, lse = flash.flash_attention(q, k, v, causal=causal, scale=scale)
                return getattr(torch.ops, f"mha_ab_{n}").flash_attention_bwd_fused(
                    go, None, q, k, v, out, lse, None, None, causal, scale)
        else:
            def call(n, q=q, k=k, v=v, causal=causal, scale=scale):
                return getattr(torch.ops, f"mha_ab_{n}")._flash_attention_fwd_kernel(
                    q, k, v, None, None, causal, scale, args.kernel)

        fns = {n: (lambda n=n, call=call: call(n)) for n in names}
        if args.check:
            ref = fns[names[0]]()[:3 if args.backward else 1]
            for n in names[1:]:
                diff = max((a.float() - b.float()).abs().max().item()
                           for a, b in zip(fns[n]()[:len(ref)], ref, strict=True))
                print(f"  {n}: max |diff| {diff:.3g}")
        with torch.no_grad():
            clock = time.thread_time if args.clock == "cpu" else time.perf_counter
            secs = _interleaved(fns, args.repeats, args.min_time, clock, args.idle, args.hold)
        flops = (14.0 if args.train else 10.0 if args.backward else 4.0) * B * h * T * T * d * (0.5 if causal else 1.0)
        base = secs[names[0]]
        row = "  ".join(f"{n} {flops / s / 1e9:6.1f} GF/s ({s / base:.3f})" for n, s in secs.items())
        print(f"{spec:>22}  {row}  load={os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
