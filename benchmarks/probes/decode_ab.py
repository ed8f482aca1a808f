"""Developer probe: A/B timing of decode kernel builds in one process, beside ONNX Runtime's
GQA step and a streaming read of the same bytes.

Each variant is decode/flash_decode.cpp from its own source tree (and/or with its own -D
flags), compiled with ``-Dmha=mha_ab_<name>`` so that several builds coexist in one process
(as ``flash_ab.py`` does for the flash kernel). All rows are timed round-robin on the same K/V
tensors. Shape legend: B batch, h / h_kv query / key-value heads, Tq = 1, Tk cached keys, d head
dim; GB/s counts the K/V bytes a step reads (``2 B h_kv Tk d`` elements).

    git -C . archive HEAD src/mha/csrc | tar -x -C /tmp/base   # the old tree
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/probes/decode_ab.py \\
        --variant old=/tmp/base/src/mha/csrc --variant new=src/mha/csrc \\
        --Tk 512 2048 8192 --threads 1 --clock cpu --pages 4k 2m

Rows: each variant; ``ort`` (``mha.bench.peers.ort_gqa_decode``: the cache copied into ORT's
own buffers, in the chosen pages too) unless ``--no-ort``; ``read`` (``csrc/bench/
stream_read.cpp``: a four-accumulator AVX-512 sum of the same bytes). ``--pages``: where K/V
live: ``4k`` (``torch.empty``: glibc's mapping, 4 KiB pages) and / or ``2m`` (the same with
``madvise(MADV_HUGEPAGE)`` before the first write: 2 MiB pages where THP allows; what
``mha.KVCache`` allocates; refused with a message where ``madvise`` is unavailable). Every
variant's output is checked against SDPA in fp32 first. The variants' ops run under
``torch.inference_mode`` (their Autograd kernels look up the package's own ``mha::`` schema).
Times are the fastest round's: on a shared machine prefer ``--threads 1 --clock cpu``; two
threads' wall clock there follows the scheduler more than the kernels (docs/decoding.md,
"Where the limits are").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import add_variant_argument, build_variant, interleaved, variants  # noqa: E402


def _build(name: str, csrc: Path, defines: list[str]) -> None:
    """Compile decode/flash_decode.cpp of ``csrc`` with its ops under mha_ab_<name>; load it."""
    build_variant(name, csrc, defines, "decode/flash_decode.cpp", "decode_ab")


def _storage(shape: tuple[int, ...], dtype: torch.dtype, pages: str) -> torch.Tensor:
    """An uninitialized tensor in 4 KiB pages (``4k``) or advised to 2 MiB pages (``2m``)."""
    if pages == "2m":
        from mha import hugepages as huge

        t = huge.empty(*shape, dtype=dtype)
        if t.nbytes >= huge.MIN_BYTES and not huge.advise(t):
            raise SystemExit("--pages 2m: madvise(MADV_HUGEPAGE) refused or unavailable here")
        return t
    return torch.empty(shape, dtype=dtype)


def _call(op, q, k, v, scale):
    """One step through a variant's op. Under inference mode: the op's Autograd kernel looks
    the package's own schema up by name (``mha::``), which ``-Dmha=`` does not rename."""
    with torch.inference_mode():
        return op(q, k, v, None, None, scale, False)


def _case(names: list[str], shape: tuple[int, ...], dtype: torch.dtype, pages: str,
          args: argparse.Namespace, clock) -> None:
    """Time every row on one cache of ``shape`` = (B, h, h_kv, Tk, d) and print the table."""
    B, h, h_kv, Tk, d = shape
    g = torch.Generator().manual_seed(0)
    k = _storage((B, h_kv, Tk, d), dtype, pages)  # (B, h_kv, Tk, d)
    v = _storage((B, h_kv, Tk, d), dtype, pages)
    k.copy_(torch.randn(B, h_kv, Tk, d, generator=g))
    v.copy_(torch.randn(B, h_kv, Tk, d, generator=g))
    q = torch.randn(B, h, 1, d, generator=g).to(dtype)  # (B, h, 1, d)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=h_kv != h)
    scale = d ** -0.5
    fns = {}
    for n in names:
        op = getattr(torch.ops, f"mha_ab_{n}").flash_decode
        fns[n] = (lambda op=op: _call(op, q, k, v, scale))
        err = (fns[n]().float() - ref).abs().max().item()
        if not err <= (1e-4 if dtype == torch.float32 else 3e-2):
            raise SystemExit(f"{n}: max |out - SDPA fp32| = {err:.1e}")
    if not args.no_ort:
        from mha.bench import peers

        fns["ort"] = peers.ort_gqa_decode(q, k, v, huge_pages=pages == "2m")
    kf, vf = k.view(torch.float32), v.view(torch.float32)  # the same bytes
    read = torch.ops.mha.stream_read
    fns["read"] = lambda: (read(kf), read(vf))
    with torch.no_grad():
        t = interleaved(fns, args.rounds, min_time=args.min_time, clock=clock, stat=min)
    gb = 2 * B * h_kv * Tk * d * k.element_size() / 1e9
    print(f"Tk {Tk} ({gb * 1e3:.0f} MB K+V), {pages} pages:")
    for n, s in t.items():
        rel = "  ".join(f"{t[o] / s:5.2f}x {o}" for o in (names[0], "ort") if o in t)
        print(f"  {n:>10} {s * 1e3:8.3f} ms {gb / s:6.1f} GB/s   {rel}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_variant_argument(ap)
    ap.add_argument("--Tk", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--h", type=int, default=32)
    ap.add_argument("--h-kv", type=int, default=None, help="default: h")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--pages", nargs="+", choices=("4k", "2m"), default=["4k"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the calling thread's CPU time (with --threads 1 every row runs on "
                         "it), so time lost to other processes is not counted")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--min-time", type=float, default=0.2)
    ap.add_argument("--no-ort", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    names = [n for n, _, _ in variants(args.variant)]
    for n, csrc, defines in variants(args.variant):
        _build(n, csrc, defines)
    from mha.ops import build

    build.load("mha_stream_read", ("bench/stream_read.cpp",))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    B, h, d = 1, args.h, args.d
    h_kv = args.h_kv or h
    print(f"threads {torch.get_num_threads()}, clock {args.clock}, {args.dtype}, B{B} h{h}/{h_kv} "
          f"d{d}, fastest of {args.rounds} interleaved rounds; load {os.getloadavg()[0]:.2f}")
    for Tk in args.Tk:
        for pages in args.pages:
            _case(names, (B, h, h_kv, Tk, d), dtype, pages, args, clock)
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
