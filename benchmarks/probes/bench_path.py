"""The bench's ``mha auto`` row against the op it ends in, side by side in one process.

Shape legend: B batch, h heads, T sequence length (Tq = Tk), d head dim; fp32 or bf16,
contiguous (B, h, T, d) inputs built as ``mha bench`` builds them (its own tensors).

Parts (each optional but ``path``, run per shape):

``path``: the same call through each layer, timed round-robin (``_timing.interleaved``) under
``torch.no_grad()`` as the bench times it, outputs checked bitwise equal first:

* ``kernel`` — ``torch.ops.mha._flash_attention_fwd_kernel(..., "auto")``, the op
  ``flash_ab.py`` times;
* ``op`` — ``torch.ops.mha.flash_attention_fwd``, the registered op with its autograd;
* ``flash`` — ``mha.ops.flash.flash_attention`` (lse to fp32);
* ``bench`` — the callable of the bench's ``mha auto`` row (``mha.bench.attention``):
  ``mha.attention``, validation, dispatch, the backend.

``--idle S``: the bench's callable right after another call (its previous output's pages
freed a moment ago, as in ``flash_ab.py``) against the same call after S seconds asleep
(``--hold M``: then M MiB written and held over the call, which takes whatever free pages the
machine touched lately, so the output gets pages freed long ago, as on an idle machine).

``--pages M`` (before the shapes): a fresh M MiB block written, in 2 MiB pages (as
``common/huge_pages.h`` advises large outputs) and in 4 KiB pages, back to back and after
``--idle`` seconds asleep with ``--hold`` MiB held: the price of an output's first write by
how long ago the guest freed the memory.

``--harness``: the callable back to back, against it in the bench's rounds (each call after
one sample of each of the case's other implementations — ``mha:*`` rows, SDPA, naive torch,
FlexAttention, ONNX Runtime, JAX — and the harness's settle pause), and the same with 2x the
output's size written and freed just before the call (``hot pages``); ``--per-impl`` adds the
call right after each other implementation alone.

Per mode: median time per call (the chosen clock), the CPU seconds per wall second of mha's
own threads (the calling thread and torch's OpenMP workers) during the call and their system
time (/proc's clock ticks of 10 ms: read them for calls of tens of ms and more; medians
and means), and (harness) the CPU time other threads of the process
(the peers' pools) spent during it.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/probes/bench_path.py \
        --shapes 1,32,2048,128,dense 4,16,2048,64,causal --threads 1 --clock cpu \
        --idle 4 --hold 1024
    ... bench_path.py --pages 32 --idle 4 --hold 1024 --threads 1 --clock cpu --repeats 5 --shapes
    ... bench_path.py --harness --threads 1 --clock cpu --shapes 1,32,2048,128,dense
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved  # noqa: E402


def _thread_cpu() -> dict[int, tuple[float, float]]:
    """(user, system) CPU seconds of every thread of this process, by thread id (clock ticks)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) / tick, int(fields[12]) / tick)  # utime, stime
    return out


def _omp_threads() -> set[int]:
    """Thread ids that run torch's parallel regions (the calling thread included)."""
    x = torch.zeros(1 << 22)
    before = _thread_cpu()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.3:  # a large elementwise op: at::parallel_for, every worker
        torch.add(x, 1.0, out=x)
    after = _thread_cpu()
    busy = {tid for tid, c in after.items() if sum(c) - sum(before.get(tid, (0, 0))) > 0.05}
    return busy | {threading.get_native_id()}


def _bench_impls(shape, dtype: str, causal: bool):
    """The bench's case for the shape: {impl name: make}."""
    from mha.bench.attention import Shape, attention_case
    from mha.bench.core import Context

    B, h, T, d = shape
    case = attention_case(Shape(B, h, T, d, dtype, causal), Context())
    return case, {impl.name: impl.make for impl in case.impls}


def path(shape, dtype: str, causal: bool, args, clock) -> None:
    import mha  # noqa: F401 (loads the ops)
    from mha.ops import flash

    B, h, T, d = shape
    case, makes = _bench_impls(shape, dtype, causal)
    with torch.no_grad():
        bench = makes["mha auto"]()
        q, k, v = _inputs(makes)  # the bench's own tensors
        scale = d ** -0.5
        fns = {
            "kernel": lambda: torch.ops.mha._flash_attention_fwd_kernel(
                q, k, v, None, None, causal, scale, "auto"),
            "op": lambda: torch.ops.mha.flash_attention_fwd(
                q, k, v, None, None, causal, scale, 0, 0.0, None, None, None, None, None),
            "flash": lambda: flash.flash_attention(q, k, v, causal=causal),
            "bench": bench,
        }
        ref = fns["kernel"]()[0]
        for name in ("op", "flash", "bench"):
            out = fns[name]()
            out = out[0] if isinstance(out, tuple) else out
            if not torch.equal(out, ref):
                raise RuntimeError(f"{name}: output differs from the kernel's")
        secs = interleaved(fns, args.repeats, min_time=args.min_time, clock=clock)
    base = secs["kernel"]
    row = "  ".join(f"{n} {case.flops / s / 1e9:6.1f} GF/s ({s / base:.3f})"
                    for n, s in secs.items())
    print(f"  path     {row}  load={os.getloadavg()[0]:.2f}", flush=True)
    case.teardown()


def _inputs(makes):
    """q, k, v the bench's case built (its _Inputs memo, shared by every impl)."""
    from mha.bench import attention

    todo = [makes["mha auto"]]
    while todo:  # the make functions' closures, depth first
        for cell in todo.pop().__closure__ or ():
            x = cell.cell_contents
            if isinstance(x, attention._Inputs):
                return x.qkv()
            if callable(x) and getattr(x, "__closure__", None):
                todo.append(x)
    raise RuntimeError("the bench's mha auto impl no longer closes over its _Inputs")


def harness(shape, dtype: str, causal: bool, args, clock) -> None:
    from mha.bench.core import Context, Skip

    case, makes = _bench_impls(shape, dtype, causal)
    ctx = Context()
    live = {}
    with torch.no_grad():
        for name, make in makes.items():
            if name != "mha auto" and args.skip and any(s in name for s in args.skip):
                continue
            try:
                live[name] = make()
            except Skip as e:
                print(f"    {name}: skipped ({str(e)[:60]})")
        for fn in live.values():
            fn()  # warm-up (compiles)
        mha_fn = live.pop("mha auto")
        mine = _omp_threads()
        out_bytes = case.params["B"] * case.params["h"] * case.params["T"] * case.params["d"] * (
            4 if dtype == "fp32" else 2)
        modes = ["alone", "in rounds", "in rounds, hot pages"]
        if args.per_impl:
            modes += [f"after {n}" for n in live]
        stats: dict[str, list[tuple[float, ...]]] = {m: [] for m in modes}

        def timed():
            c0, t0, w0 = _thread_cpu(), clock(), time.perf_counter()
            mha_fn()
            t, w, c1 = clock() - t0, time.perf_counter() - w0, _thread_cpu()
            d = {i: (u - c0.get(i, (0, 0))[0], st - c0.get(i, (0, 0))[1])
                 for i, (u, st) in c1.items()}
            own = sum(sum(d[i]) for i in mine if i in d)
            own_sys = sum(d[i][1] for i in mine if i in d)
            other = sum(sum(x) for i, x in d.items() if i not in mine)
            return t, own / w, own_sys, other

        def sample(fn):  # one bench sample: calls for ~ctx.sample_time, then the settle
            t0, n = time.perf_counter(), 0
            while n == 0 or time.perf_counter() - t0 < ctx.sample_time:
                fn()
                n += 1
            time.sleep(ctx.settle)

        for _ in range(args.repeats):
            mha_fn()
            time.sleep(ctx.settle)
            stats["alone"].append(timed())
            for hot in (False, True):
                for fn in live.values():
                    sample(fn)
                if hot:  # freshly freed pages where mha's output will be mapped (untimed)
                    _hot_pages(2 * out_bytes)
                stats["in rounds, hot pages" if hot else "in rounds"].append(timed())
                time.sleep(ctx.settle)
            if args.per_impl:
                for name, fn in live.items():
                    sample(fn)
                    stats[f"after {name}"].append(timed())
                    time.sleep(ctx.settle)
    base = statistics.median(s[0] for s in stats["alone"])
    for mode, ss in stats.items():
        t, share, own_sys, other = (statistics.median(s[i] for s in ss) for i in range(4))
        print(f"  harness  {mode:<22} {case.flops / t / 1e9:6.1f} GF/s ({t / base:.3f})"
              f"  own CPU/wall {share:.2f}, system {own_sys * 1e3:3.0f} ms"
              f" (mean {statistics.mean(s[2] for s in ss) * 1e3:3.0f})"
              f"  others' CPU {other * 1e3:3.0f} ms", flush=True)
    print(f"    load={os.getloadavg()[0]:.2f}")
    case.teardown()


def idle(shape, dtype: str, causal: bool, args, clock) -> None:
    """The bench's mha auto call right after another (its last output's pages freed a moment
    ago) against the same call after ``args.idle`` seconds asleep (pages freed that long ago)."""
    case, makes = _bench_impls(shape, dtype, causal)
    mine = _omp_threads()
    stats: dict[str, list[tuple[float, float, float]]] = {"back to back": [],
                                                          f"after {args.idle:g} s idle": []}
    with torch.no_grad():
        fn = makes["mha auto"]()
        for _ in range(args.repeats):
            for mode in stats:
                fn()
                held = None
                if mode != "back to back":
                    time.sleep(args.idle)
                    if args.hold:  # takes the free pages touched lately (machine-wide) first
                        held = touched(args.hold << 20)
                c0, t0, w0 = _thread_cpu(), clock(), time.perf_counter()
                fn()
                del held
                t, w, c1 = clock() - t0, time.perf_counter() - w0, _thread_cpu()
                own = [(c1[i][0] - c0.get(i, (0, 0))[0], c1[i][1] - c0.get(i, (0, 0))[1])
                       for i in mine if i in c1]
                stats[mode].append((t, sum(u + st for u, st in own) / w,
                                    sum(st for _, st in own)))
    base = statistics.median(s[0] for s in stats["back to back"])
    for mode, ss in stats.items():
        t, share, own_sys = (statistics.median(s[i] for s in ss) for i in range(3))
        print(f"  idle     {mode:<22} {case.flops / t / 1e9:6.1f} GF/s ({t / base:.3f})"
              f"  own CPU/wall {share:.2f}, system {own_sys * 1e3:3.0f} ms"
              f" (mean {statistics.mean(s[2] for s in ss) * 1e3:3.0f})", flush=True)
    print(f"    load={os.getloadavg()[0]:.2f}")
    case.teardown()


def pages(args, clock) -> None:
    """What writing a fresh ``args.pages`` MiB block costs (an output of that size): in 2 MiB
    pages (``MADV_HUGEPAGE``, as ``common/huge_pages.h`` advises outputs of 32 MiB and more)
    and in 4 KiB pages, each right after the same write (back to back) and after ``--idle``
    seconds asleep with ``--hold`` MiB written and held first."""
    def write(huge: bool) -> float:
        t0 = clock()
        if huge:
            x = touched(args.pages << 20)
        else:
            x = torch.empty((args.pages << 20) // 4)
            x.fill_(1.0)
        t = clock() - t0
        del x
        return t

    after = f"after {args.idle:g} s idle, {args.hold} MiB held"
    for huge in (True, False):
        for mode in ("back to back", after):
            ts = []
            for _ in range(args.repeats):
                write(huge)
                held = None
                if mode != "back to back":
                    time.sleep(args.idle)
                    held = touched(args.hold << 20) if args.hold else None
                ts.append(write(huge))
                del held
            print(f"  pages    {args.pages} MiB in {'2 MiB' if huge else '4 KiB'} pages, "
                  f"{mode:<30} {statistics.median(ts) * 1e3:6.1f} ms "
                  f"(min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f})", flush=True)
    print(f"    load={os.getloadavg()[0]:.2f}")


def _hot_pages(nbytes: int) -> None:
    """Map, write and free ``nbytes`` in 2 MiB pages: the kernel's free lists then start with
    pages this guest touched a moment ago."""
    touched(nbytes)  # freed on return


def touched(nbytes: int) -> torch.Tensor:
    """``nbytes`` mapped in 2 MiB pages (where THP allows) and written (``flash_ab.py --hold``
    uses it too)."""
    x = torch.empty(nbytes // 4)
    p = x.data_ptr()
    a, e = (p + (2 << 20) - 1) & ~((2 << 20) - 1), (p + nbytes) & ~((2 << 20) - 1)
    if e > a:
        _LIBC.madvise(ctypes.c_void_p(a), ctypes.c_size_t(e - a), 14)  # MADV_HUGEPAGE
    x.fill_(0.0)
    return x


_LIBC = ctypes.CDLL("libc.so.6")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["1,32,2048,128,dense", "4,16,2048,64,causal",
                                                    "1,8,4096,64,causal"],
                    help="B,h,T,d,{dense|causal}")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the calling thread's CPU time (meaningful with --threads 1)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--min-time", type=float, default=0.0)
    ap.add_argument("--harness", action="store_true", help="also the harness part")
    ap.add_argument("--idle", type=float, default=0.0,
                    help="also time the call after this many seconds asleep against back to back")
    ap.add_argument("--pages", type=int, default=0,
                    help="first the cost of writing a fresh block of this many MiB (2 MiB / 4 KiB pages)")
    ap.add_argument("--hold", type=int, default=0,
                    help="--idle: MiB mapped and written after the sleep, held over the call")
    ap.add_argument("--per-impl", action="store_true",
                    help="harness: also mha's call right after each other impl alone")
    ap.add_argument("--skip", nargs="*", default=[],
                    help="harness: leave out impls whose name contains one of these")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    print(f"threads={torch.get_num_threads()} clock={args.clock} "
          f"load={os.getloadavg()[0]:.2f}", flush=True)
    if args.pages:
        pages(args, clock)
    for spec in args.shapes:
        B, h, T, d, mode = spec.split(",")
        shape, causal = (int(B), int(h), int(T), int(d)), mode == "causal"
        print(f"{spec} {args.dtype}", flush=True)
        path(shape, args.dtype, causal, args, clock)
        if args.idle:
            idle(shape, args.dtype, causal, args, clock)
        if args.harness:
            harness(shape, args.dtype, causal, args, clock)


if __name__ == "__main__":
    main()
