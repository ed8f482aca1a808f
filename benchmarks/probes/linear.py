"""mha.linear against F.linear and against its former self (a packed copy of W^T kept on the
weight), for the cost of packing the weight inside every call.

Shape legend: M rows (B * T), K input features, N output features; the module rows are the seeds'
(B = 32, T = 20, d_model = 512, h = 8) and (B = 1, T = 2048, causal). One process, calls
interleaved round-robin, medians. GFLOP/s count 2 M N K for the forward and 3x that for
forward + backward.

``--old-rev REV`` builds ``csrc/linear.cpp`` as it was at git revision REV (its ops renamed into
the namespace ``mha_old``, against its own headers) and times it the way that revision ran it:
the weight packed in Python once and the packed copy reused while the weight's version counter
stays put (repacked after each optimizer step). Where the CPU has no AVX-512 the native op has
only its portable loops and ``mha.linear`` falls back to F.linear; ``--portable`` times those
loops anyway (both trees), which measures packing against a slower GEMM than the AVX-512 tiles.

    OPENBLAS_CORETYPE= OPENBLAS_L2_SIZE= .venv/bin/python benchmarks/probes/linear.py --old-rev 263ecb3
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

import mha
import mha.module
from _timing import interleaved
from mha.ops import build, linear

SHAPES = ((640, 512, 1536), (640, 512, 512), (2048, 512, 1536), (2048, 2048, 2048),
          (16, 512, 1536))
PANEL = 64  # output columns per packed panel (csrc/linear.cpp kPanel)


# ----------------------------------------------------------------------------- the former path
def build_old(rev: str) -> None:
    """Build the linear op of ``rev`` (``csrc/linear/linear.cpp``, or ``csrc/linear.cpp`` in
    the flat layout) with its ops in the namespace ``mha_old``, against that revision's own
    headers (its csrc tree is extracted beside the build)."""
    root = Path(__file__).resolve().parents[2]
    tmp = build.cache_root() / f"mha_linear_old-{rev}"  # a rebuild only when the text changes
    tmp.mkdir(parents=True, exist_ok=True)
    tree = subprocess.run(["git", "archive", rev, "src/mha/csrc"], cwd=root, check=True,
                          capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=tree, check=True)
    csrc = tmp / "src" / "mha" / "csrc"
    linear = csrc / "linear" / "linear.cpp"
    src = (linear if linear.exists() else csrc / "linear.cpp").read_text()
    for lib in ("TORCH_LIBRARY_FRAGMENT(mha,", "TORCH_LIBRARY_IMPL(mha,"):
        src = src.replace(lib, lib.replace("(mha,", "(mha_old,"))
    if not (tmp / "linear_old.cpp").exists() or (tmp / "linear_old.cpp").read_text() != src:
        (tmp / "linear_old.cpp").write_text(src)
    from torch.utils import cpp_extension

    cpp_extension.load(name="mha_linear_old", sources=[str(tmp / "linear_old.cpp")],
                       extra_cflags=list(build.FLAGS), extra_ldflags=list(build.LDFLAGS),
                       extra_include_paths=[str(csrc)], build_directory=str(tmp),
                       is_python_module=False)


def old_pack(weight: torch.Tensor) -> torch.Tensor:
    """``(N, K)`` -> ``(ceil(N / 64), K, 64)``: W^T in 64-column panels, zero past N."""
    N, K = weight.shape
    P = -(-N // PANEL)
    w = F.pad(weight.detach(), (0, 0, 0, P * PANEL - N))  # (P * 64, K)
    return w.view(P, PANEL, K).transpose(1, 2).contiguous()  # (P, 64, K) -> (P, K, 64)


_OLD_CACHE: dict = {}


def old_packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The former cache (there an attribute of the weight, here a dict by the weight's id):
    keyed by storage and version counter, so it went stale when a write bumped no version."""
    holder = weight if weight._base is None else weight._base
    cache = _OLD_CACHE.get(id(holder))
    if cache is None or cache[0] != (holder.data_ptr(), holder._version):
        cache = ((holder.data_ptr(), holder._version), {})  # a new version drops every entry
        _OLD_CACHE[id(holder)] = cache
    key = (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()))
    if key not in cache[1]:
        cache[1][key] = old_pack(weight)
    return cache[1][key]


class _OldLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias):  # x2 (M, K), weight (N, K), bias (N,) or None
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mha_old.linear_packed(x2, old_packed_weight(weight), bias,
                                               weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):  # grad_out (M, N)
        x2, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        gx, gw = torch.ops.mha_old.linear_backward(grad_out, x2, weight, need_x, need_w)
        gb = grad_out.sum(0) if ctx.has_bias and need_b else None  # (M, N) -> (N,)
        return (gx if need_x else None), (gw if need_w else None), gb


def old_linear(x, weight, bias=None):
    if linear.why_not_native(x, weight, bias) is not None:
        return F.linear(x, weight, bias)
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)  # (..., K) -> (M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, weight, bias)):
        out = _OldLinear.apply(x2, weight, bias)
    else:
        out = torch.ops.mha_old.linear_packed(x2, old_packed_weight(weight), bias,
                                              weight.shape[0])
    return out.view(*lead, weight.shape[0])  # (M, N) -> (..., N)


# ----------------------------------------------------------------------------- the rows
def _impls(old: bool) -> dict:
    impls = {"mha": linear.linear, "torch": F.linear}
    if old:
        impls["old"] = old_linear
    return impls


def _ratios(t: dict, unit: str, work: float) -> str:
    parts = [f"{name} {work / t[name] / 1e9:.0f}" if work else f"{name} {t[name] * 1e3:.2f}"
             for name in t]
    rel = [f"{name} {t[name] / t['mha']:.2f}x" for name in t if name != "mha"]
    return f"{', '.join(parts)} {unit} (mha's speed-up over {', '.join(rel)})"


def _shape(M: int, K: int, N: int, rounds: int, old: bool) -> list[str]:
    x = torch.randn(M, K, requires_grad=True)
    w = torch.randn(N, K, requires_grad=True)
    b = torch.randn(N, requires_grad=True)
    gy = torch.randn(M, N)

    def fwd(f):
        def run():
            with torch.no_grad():
                f(x, w, b)
        return run

    def train(f):
        return lambda: torch.autograd.grad(f(x, w, b), (x, w, b), gy)

    impls = _impls(old)
    fl = 2.0 * M * N * K
    tf = interleaved({n: fwd(f) for n, f in impls.items()}, rounds, min_time=0.05)
    tt = interleaved({n: train(f) for n, f in impls.items()}, rounds, min_time=0.05)
    return [f"{M}x{K}x{N} forward: {_ratios(tf, 'GFLOP/s', fl)}",
            f"{M}x{K}x{N} forward + backward: {_ratios(tt, 'GFLOP/s', 3 * fl)}"]


def _with(impl, fn):
    """``fn`` with the module's projections on ``impl`` (mha.module.linear rebound)."""
    def run():
        mha.module.linear = impl
        try:
            return fn()
        finally:
            mha.module.linear = linear.linear
    return run


def _module_rows(rounds: int, old: bool) -> list[str]:
    rows = []
    for B, T, causal in ((32, 20, False), (1, 2048, True)):
        m = mha.MultiHeadAttention(512, 8)
        tm = m.to_torch()
        x = torch.randn(B, T, 512)
        allowed = ~torch.ones(T, T, dtype=torch.bool).triu(1) if causal else None

        def call_mha(m=m, x=x, causal=causal):
            with torch.no_grad():
                m(x, causal=causal)

        def call_torch(tm=tm, x=x, allowed=allowed):
            with torch.no_grad():
                tm(x, x, x, need_weights=False, attn_mask=None if allowed is None else ~allowed)

        fns = {"mha": _with(linear.linear, call_mha), "torch": call_torch}
        if old:
            fns["old"] = _with(old_linear, call_mha)
        t = interleaved(fns, rounds, min_time=0.1)
        rows.append(f"module B{B} T{T} d_model512 h8{' causal' if causal else ''} forward: "
                    f"{_ratios(t, 'ms', 0)}")
    m = mha.MultiHeadAttention(512, 8)
    tm = m.to_torch()
    x = torch.randn(32, 20, 512)

    def step(mod, call):
        opt = torch.optim.SGD(mod.parameters(), lr=1e-4)

        def run():
            opt.zero_grad()
            call().square().mean().backward()
            opt.step()  # the weights change (the former path repacks them at the next call)
        return run

    fns = {"mha": _with(linear.linear, step(m, lambda: m(x))),
           "torch": step(tm, lambda: tm(x, x, x, need_weights=False)[0])}
    if old:
        mo = mha.MultiHeadAttention(512, 8)
        fns["old"] = _with(old_linear, step(mo, lambda: mo(x)))
    t = interleaved(fns, rounds, min_time=0.1)
    rows.append(f"module training step B32 T20 d_model512 h8 (SGD): {_ratios(t, 'ms', 0)}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--old-rev", help="git revision whose csrc/linear.cpp to time alongside")
    ap.add_argument("--portable", action="store_true",
                    help="time the native op's portable loops where AVX-512 is missing")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    reason = linear.load()
    if reason is not None and args.portable and hasattr(torch.ops.mha, "linear_vectorized"):
        linear.load = lambda: None  # benchmark only: the portable loops instead of F.linear
        reason = f"yes, portable loops ({reason})"
    print(f"threads {torch.get_num_threads()}; native: {reason or 'yes'}")
    if args.old_rev:
        build_old(args.old_rev)
    for M, K, N in SHAPES:
        for row in _shape(M, K, N, args.rounds, bool(args.old_rev)):
            print(row, flush=True)
    for row in _module_rows(args.rounds, bool(args.old_rev)):
        print(row, flush=True)


if __name__ == "__main__":
    main()
