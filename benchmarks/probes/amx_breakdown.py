"""Where the bf16 AMX forward's time goes: tile products, softmax, and the rest, per key step.

The kernel's parts cannot be timed apart inside one build (the tile unit and the vector units
do not overlap, so a sampling profile smears them), so this script builds the benchmark-only
translation unit ``csrc/bench/flash_breakdown.cpp``: the forward with a policy that leaves the
tile products and / or the softmax out of the AMX key loop (both out: only the loop, packing
and output remain), as the op ``_flash_breakdown_fwd``. Those variants compute wrong results:
they exist only to be timed; the package's extensions never contain them. Each variant runs in
its own process, rounds alternate between the variants, and the best time per variant is kept:

    tiles   = t(no softmax) - t(neither)      (Q K^T and P V on the tile unit, S stores)
    softmax = t(no tiles)   - t(neither)      (the AVX-512 exp2 pass, P packing, bookkeeping)
    rest    = t(neither)                      (K / V / Q packing, output, loop control)
    extra   = t(full) - (tiles + softmax + rest)   (> 0: the parts cost more together than
                                                    apart; < 0: they overlap)

Figures are per 16-row x 128-key step (one tile group, one key block), in TSC-rate cycles
(``--ghz``, the machine's nominal 2.6 GHz) per thread. Needs the AMX kernel (``mha build``
reports ``amx``); the first run builds the benchmark unit (cached).

    OPENBLAS_CORETYPE= OPENBLAS_L2_SIZE= .venv/bin/python benchmarks/amx_breakdown.py
    .venv/bin/python benchmarks/amx_breakdown.py --shapes 1,32,2048,128 --threads 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {  # (tile products, softmax)
    "full": (True, True),
    "no softmax": (True, False),
    "no tiles": (False, True),
    "neither": (False, False),
}


def _load_breakdown() -> None:
    """Build (cached) and load bench/flash_breakdown.cpp into this process."""
    from torch.utils import cpp_extension

    from mha.ops import build

    flags = build.FLAGS
    src = build.CSRC / "bench" / "flash_breakdown.cpp"
    h = hashlib.sha256(" ".join(flags).encode())
    for f in [*sorted(build.CSRC.rglob("*.cpp")), *sorted(build.CSRC.rglob("*.h"))]:
        h.update(f.read_bytes())
    name = f"mha_flash_breakdown_{h.hexdigest()[:12]}"
    build_dir = build.cache_root() / name
    lib = build_dir / f"{name}.so"
    import torch

    if lib.exists():
        torch.ops.load_library(str(lib))
        return
    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(src)],
        extra_cflags=list(flags),
        extra_ldflags=list(build.LDFLAGS),
        extra_include_paths=[str(build.CSRC)],
        build_directory=str(build_dir),
        is_python_module=False,
    )


def _child(variant: str, shapes: list[str], threads: int, repeats: int) -> None:
    import torch

    torch.set_num_threads(threads)
    _load_breakdown()
    tiles, softmax = VARIANTS[variant]
    out = {}
    for spec in shapes:
        B, h, T, d = map(int, spec.split(","))
        # the module's layout: (B, T, h, d) viewed as (B, h, T, d)
        q, k, v = (torch.randn(B, T, h, d).bfloat16().transpose(1, 2) for _ in range(3))
        args = (q, k, v, d**-0.5, tiles, softmax)
        torch.ops.mha._flash_breakdown_fwd(*args)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.ops.mha._flash_breakdown_fwd(*args)
            best = min(best, time.perf_counter() - t0)
        out[spec] = best
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shapes",
        nargs="*",
        default=["1,8,4096,64", "1,32,2048,128"],
        help="B,h,T,d (dense, Tq = Tk)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per process")
    ap.add_argument("--rounds", type=int, default=3, help="processes per variant, alternating")
    ap.add_argument("--ghz", type=float, default=2.6, help="cycle rate the figures are given in")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args.child, args.shapes, args.threads, args.repeats)

    best: dict[str, dict[str, float]] = {v: {} for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS:
            print(f"round {r + 1}/{args.rounds}: {variant}", file=sys.stderr, flush=True)
            res = subprocess.run(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--child",
                    variant,
                    "--shapes",
                    *args.shapes,
                    "--threads",
                    str(args.threads),
                    "--repeats",
                    str(args.repeats),
                ],
                capture_output=True,
                text=True,
            )
            if res.returncode != 0:  # e.g. no AMX here: the "amx" kernel is not compiled in
                sys.exit(f"variant {variant!r} failed:\n{res.stderr.strip()[-2000:]}")
            for spec, t in json.loads(res.stdout.strip().splitlines()[-1]).items():
                best[variant][spec] = min(best[variant].get(spec, float("inf")), t)

    print(f"threads={args.threads}; cycles at {args.ghz} GHz per 16x128 step per thread")
    print(f"{'shape':>16} {'full':>7} {'tiles':>7} {'softmax':>8} {'rest':>7} {'extra':>8}")
    for spec in args.shapes:
        B, h, T, d = map(int, spec.split(","))
        steps = B * h * (T / 16) * (T / 128) / args.threads
        cyc = {v: best[v][spec] * args.ghz * 1e9 / steps for v in VARIANTS}
        tiles = cyc["no softmax"] - cyc["neither"]
        soft = cyc["no tiles"] - cyc["neither"]
        rest = cyc["neither"]
        extra = cyc["full"] - (tiles + soft + rest)
        print(f"{spec:>16} {cyc['full']:7.0f} {tiles:7.0f} {soft:8.0f} {rest:7.0f} {extra:8.0f}")


if __name__ == "__main__":
    main()
