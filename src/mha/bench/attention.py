"""The attention suite: mha's backends, mha's dispatch and the peers, per shape.

Shape legend: B batch, h heads, T sequence length (Tq = Tk = T), d head dim, d_model = h * d.

Cases are ``(B, h, T, d)`` × dtype × dense/causal, named like ``1x8x4096x64 fp32 causal``; FLOPs
are ``4·B·h·T²·d`` (two matmuls), half of that when causal (only the FLOPs the mask keeps).
Module cases (``module ...``) time ``torch.nn.MultiheadAttention`` against
``mha.MultiHeadAttention`` with the same weights (projections included in FLOPs and time).
Training cases (``train ...``) time one forward + backward, ``torch.autograd.grad`` of
``mha.attention`` vs SDPA, gradients checked against fp32 SDPA's; FLOPs 3.5x the forward's.

Every implementation's output (its first call) is checked against fp32 SDPA (up to
``_CHECK_MAX`` score elements); a wrong result is an error row, not a number. The seed-000
reference loop is timed on small cases only (``_REFERENCE_MAX``); on cases of more than
``_LARGE_FLOPS`` FLOPs (seconds per call) mha is represented by ``mha auto`` alone. Implementations that
materialize the ``(B, h, T, T)`` scores are skipped, with the figure, when that would exceed
``ctx.mem_budget``; SDPA (its CPU flash kernel), FlexAttention and ``flash_cpu`` never do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mha.bench import peers
from mha.bench.core import Case, Context, Impl, Skip

TITLE = ("attention forward: mha backends vs torch SDPA, naive, FlexAttention, ONNX Runtime, JAX; "
         "training steps (forward + backward) vs torch SDPA")

GiB = 2**30
_CHECK_MAX = 2**28  # score elements up to which outputs are checked against SDPA
_REFERENCE_MAX = 2**24  # score elements up to which the per-head reference loop is timed
_LARGE_FLOPS = 2e11  # from here on, "mha auto" stands for mha (no per-backend duplicates)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_TOL = {"fp32": 2e-4, "bf16": 3e-2}  # max abs error vs the fp32 SDPA output (unit-normal inputs)


@dataclass(frozen=True)
class Shape:
    B: int
    h: int
    T: int
    d: int
    dtype: str  # fp32 | bf16
    causal: bool

    @property
    def name(self) -> str:
        return (f"{self.B}x{self.h}x{self.T}x{self.d} {self.dtype} "
                f"{'causal' if self.causal else 'dense'}")

    @property
    def flops(self) -> float:
        dense = 4.0 * self.B * self.h * self.T * self.T * self.d  # QK^T and AV, 2 FLOPs per MAC
        return dense / 2 if self.causal else dense

    def scores_bytes(self, itemsize: int = 4) -> int:
        return self.B * self.h * self.T * self.T * itemsize  # (B, h, T, T)


def grid(quick: bool) -> tuple[list[Shape], list[Shape]]:
    """``(attention shapes, module shapes)``; module shapes use d_model = h * d."""
    S = Shape
    if quick:
        return ([S(32, 8, 20, 64, "fp32", False), S(1, 8, 512, 64, "fp32", True),
                 S(1, 4, 256, 64, "bf16", False)],
                [S(32, 8, 20, 64, "fp32", False)])
    attn = [
        S(32, 8, 20, 64, "fp32", False), S(32, 8, 20, 64, "fp32", True),
        S(32, 8, 20, 64, "bf16", False), S(32, 8, 20, 64, "bf16", True),
        S(1, 8, 512, 64, "fp32", False), S(1, 8, 2048, 64, "fp32", False),
        S(1, 8, 2048, 64, "fp32", True),
        S(1, 8, 4096, 64, "fp32", False), S(1, 8, 4096, 64, "fp32", True),
        S(1, 8, 4096, 64, "bf16", False), S(1, 8, 4096, 64, "bf16", True),
        S(1, 32, 2048, 128, "fp32", False), S(1, 32, 2048, 128, "bf16", False),
        S(4, 16, 2048, 64, "fp32", True), S(4, 16, 2048, 64, "bf16", True),
        S(1, 8, 16384, 64, "fp32", True),
        S(1, 1, 65536, 64, "fp32", True),  # bounded memory: the scores alone would be 16 GiB
    ]
    modules = [S(32, 8, 20, 64, "fp32", False), S(32, 8, 20, 64, "bf16", False),
               S(8, 16, 512, 64, "fp32", False), S(8, 16, 512, 64, "bf16", False),
               S(1, 8, 2048, 64, "fp32", True)]
    return attn, modules


class _Inputs:
    """q, k, v (and the fp32 SDPA output) for one shape, built on first use, freed by clear."""

    def __init__(self, s: Shape):
        self.s, self._qkv, self._expected = s, None, None

    def qkv(self):
        if self._qkv is None:
            g = torch.Generator().manual_seed(0)
            s = self.s
            self._qkv = tuple(torch.randn(s.B, s.h, s.T, s.d, generator=g)  # (B, h, T, d)
                              .to(_DTYPES[s.dtype]) for _ in range(3))
        return self._qkv

    def expected(self):
        if self._expected is None:
            q, k, v = (x.float() for x in self.qkv())
            self._expected = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=self.s.causal)  # (B, h, T, d)
        return self._expected

    def clear(self):
        self._qkv = self._expected = None


def _as_bhtd(out, s: Shape) -> torch.Tensor:
    """Any implementation's output as a float32 ``(B, h, T, d)`` torch tensor."""
    import numpy as np

    if isinstance(out, (list, tuple)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        out = torch.from_numpy(np.array(out, dtype=np.float32))  # a writable copy
    out = out.float()
    if out.shape == (s.B, s.h, s.T, s.d):
        return out
    return out.reshape(s.B, s.T, s.h, s.d).transpose(1, 2)  # (B, T, h*d) or (B, T, h, d) -> (B, h, T, d)


def _checked(make, inputs: _Inputs, s: Shape, tol: float):
    """Wrap an adapter: build it, check one output against fp32 SDPA, return the callable."""

    def verify(out) -> str:
        err = float((_as_bhtd(out, s) - inputs.expected()).abs().max())
        if not err <= tol:  # also catches NaN
            raise RuntimeError(f"wrong result: max |out - SDPA fp32| = {err:.3g} > {tol}")
        return f"max |out - SDPA fp32| = {err:.1e}"

    def build():
        fn = make()
        if s.scores_bytes(1) <= _CHECK_MAX:
            fn.verify = verify  # the harness hands it the first call's output
        return fn

    return build


def _budget(need: float, ctx: Context, what: str):
    if need > ctx.mem_budget:
        raise Skip(f"would need {need / GiB:.1f} GiB for {what} "
                   f"(memory budget {ctx.mem_budget / GiB:.0f} GiB, --mem-budget)")


def _mha_backend(name: str, inputs: _Inputs, s: Shape, ctx: Context):
    import mha

    def make():
        q, k, v = inputs.qkv()
        verdict = next(vd for vd in mha.explain(q, k, v, causal=s.causal) if vd.backend == name)
        if not verdict.ok:
            raise Skip("unavailable: " + "; ".join(verdict.reasons))
        if name == "math":
            _budget(2 * s.scores_bytes() + s.T * s.T, ctx, "the (B, h, T, T) scores")
        if name == "reference" and s.scores_bytes(1) > _REFERENCE_MAX:
            raise Skip("the seed-000 per-head loop is the readable oracle, not a fast path: "
                       f"timed only up to {_REFERENCE_MAX:,} score elements (B*h*T*T)")
        return lambda: mha.attention(q, k, v, causal=s.causal, backend=name)

    return make


def _mha_auto(inputs: _Inputs, s: Shape):
    import mha

    def make():
        q, k, v = inputs.qkv()
        fn = lambda: mha.attention(q, k, v, causal=s.causal)  # noqa: E731
        fn.note = f"dispatch chose {mha.explain(q, k, v, causal=s.causal).chosen}"
        return fn

    return make


def _peer(adapter, inputs: _Inputs, s: Shape, ctx: Context, *, need: float = 0.0,
          what: str = "the (B, h, T, T) scores"):
    def make():
        _budget(need, ctx, what)
        q, k, v = inputs.qkv()
        return adapter(q, k, v, s.causal)

    return make


def _backends_for(s: Shape) -> list[str]:
    """mha's backends to show: those that can serve the shape, and those that cannot run here
    at all (their row says why). Decided on zero-memory expanded tensors."""
    import mha
    from mha import backends

    q = torch.zeros((), dtype=_DTYPES[s.dtype]).expand(s.B, s.h, s.T, s.d)  # (B, h, T, d), no memory
    names = []
    for v in mha.explain(q, q, q, causal=s.causal):
        if v.ok or backends.get(v.backend).unavailable():
            names.append(v.backend)
    return names


def attention_case(s: Shape, ctx: Context) -> Case:
    inp = _Inputs(s)
    tol = _TOL[s.dtype]
    S4 = s.scores_bytes(4)
    names = _backends_for(s)
    if s.flops >= _LARGE_FLOPS:  # seconds per call: keep time for the peers
        from mha import backends

        names = [b for b in names if backends.get(b).unavailable()]
    impls = [Impl(f"mha:{b}", _checked(_mha_backend(b, inp, s, ctx), inp, s, tol))
             for b in names]
    impls += [
        Impl("mha auto", _checked(_mha_auto(inp, s), inp, s, tol)),
        Impl("torch sdpa", _checked(_peer(peers.sdpa, inp, s, ctx), inp, s, tol)),
        Impl("naive torch", _checked(_peer(peers.naive, inp, s, ctx,
                                           need=2 * s.scores_bytes(_DTYPES[s.dtype].itemsize)
                                           + s.T * s.T), inp, s, tol)),
        Impl("flex compiled", _checked(_flex(inp, s, ctx), inp, s, tol)),
        Impl("onnxrt MHA", _checked(_peer(peers.ort_mha, inp, s, ctx, need=S4), inp, s, 1e-2)),
        Impl("onnxrt GQA", _checked(_peer(peers.ort_gqa, inp, s, ctx, need=S4), inp, s, 1e-2)),
        Impl("jax xla", _checked(_peer(peers.jax_dpa, inp, s, ctx, need=2 * S4), inp, s, tol)),
    ]
    return Case(name=s.name, impls=impls, flops=s.flops, metric="gflops", baseline="torch sdpa",
                peak=s.dtype, params=dict(B=s.B, h=s.h, T=s.T, d=s.d, dtype=s.dtype,
                                          causal=s.causal),
                teardown=inp.clear)


def _flex(inp: _Inputs, s: Shape, ctx: Context):
    def make():
        if ctx.quick:
            raise Skip("not in --quick: torch.compile takes ~10-80 s per shape here")
        q, k, v = inp.qkv()
        return peers.flex(q, k, v, s.causal)

    return make


def module_case(s: Shape, ctx: Context) -> Case:
    """``nn.MultiheadAttention`` vs ``mha.MultiHeadAttention`` (same weights), x (B, T, d_model);
    where the fused forward can serve the shape, also the module frozen (weights packed once)."""
    import mha
    from mha.ops import self_attention as fused_forward

    d_model = s.h * s.d
    dtype = _DTYPES[s.dtype]
    state: dict = {}

    def setup() -> dict:
        if not state:
            torch.manual_seed(0)
            state["x"] = torch.randn(s.B, s.T, d_model).to(dtype)  # (B, T, d_model)
            state["torch"] = peers.torch_module(d_model, s.h, dtype)
        return state

    def make_torch():
        st = setup()
        return peers.torch_module_call(st["torch"], st["x"], s.causal)

    def make_mha(frozen: bool = False):
        st = setup()
        m = mha.MultiHeadAttention.from_torch(st["torch"]).to(dtype).eval()
        if frozen:
            try:
                m.freeze()
            except (ValueError, RuntimeError) as e:
                raise Skip(str(e)) from None
        x = st["x"]
        fn = lambda: m(x, causal=s.causal)  # noqa: E731

        def verify(out) -> str:
            ref = peers.torch_module_call(st["torch"], x, s.causal)()[0].float()
            err = float((out.float() - ref).abs().max())
            tol = 1e-4 if s.dtype == "fp32" else 5e-2
            if not err <= tol:  # also catches NaN
                raise RuntimeError(f"wrong result: max |out - nn.MultiheadAttention| = {err:.3g}")
            return (f"same weights as nn.MultiheadAttention: max err {err:.1e}; "
                    f"projections: {_gemms(m, x, s.causal)}")

        if s.scores_bytes(1) <= _CHECK_MAX:
            fn.verify = verify
        return fn

    proj = 4 * 2.0 * s.B * s.T * d_model * d_model  # Q, K, V, O projections
    impls = [Impl("torch nn.MHA", make_torch), Impl("mha module", make_mha)]
    if s.T <= fused_forward.MAX_T and not s.causal:  # shapes the fused forward can serve
        # freeze() packs the fused forward's weights once (opt-in; bf16 and fp32)
        impls.append(Impl("mha module frozen", lambda: make_mha(frozen=True)))
    return Case(name=f"module B{s.B} T{s.T} d_model{d_model} h{s.h} {s.dtype} "
                     f"{'causal' if s.causal else 'dense'}",
                impls=impls,
                flops=proj + s.flops, metric="gflops", baseline="torch nn.MHA", peak=s.dtype,
                params=dict(B=s.B, T=s.T, d_model=d_model, h=s.h, dtype=s.dtype,
                            causal=s.causal, module=True),
                teardown=state.clear)


def _gemms(m, x: torch.Tensor, causal: bool) -> str:
    """Which GEMM the module's QKV and W_O projections ran (mha.linear.describe, first words),
    or that the timed call (under no_grad) ran the fused forward (m.explain's last line)."""
    from mha.linear import describe

    with torch.no_grad():
        if m.explain(x, causal=causal).splitlines()[-1].startswith("forward: fused"):
            kind = "bf16" if x.dtype == torch.bfloat16 else "fp32"
            return (f"fused {kind} forward (QKV, attention and W_O in one call on the {kind} "
                    f"tiles" + ("; weights packed once by freeze())" if m.frozen is not None
                                else ")"))
    w_o = m.out_proj.weight
    sides = [describe(inp, w, None).split(":")[0] for inp, w in
             ((x, m.in_proj.weight), (x.new_empty(()).expand(*x.shape[:-1], w_o.shape[1]), w_o))]
    return f"QKV on {sides[0]}, W_O on {sides[1]}"


def train_grid(quick: bool) -> list[Shape]:
    """Shapes of the training rows (forward + backward)."""
    S = Shape
    if quick:
        return [S(32, 8, 20, 64, "fp32", False)]
    return [S(32, 8, 20, 64, "fp32", False), S(4, 8, 512, 64, "fp32", True),
            S(1, 8, 2048, 64, "fp32", True), S(1, 8, 2048, 64, "bf16", True),
            S(1, 8, 4096, 64, "fp32", False)]


_TRAIN_TOL = {"fp32": 1e-4, "bf16": 5e-2}  # max grad error vs fp32 SDPA, relative to max |grad|


def train_case(s: Shape, ctx: Context) -> Case:
    """One training step, ``dq, dk, dv = grad(attention(q, k, v), (q, k, v), g)``: torch SDPA vs
    ``mha.attention`` (its dispatch: flash_cpu's forward and fused backward on the CPU).
    FLOPs: 3.5x the forward's (the backward's dV, dP, dQ, dK matmuls; not its recomputed S)."""
    import mha

    inp = _Inputs(s)
    state: dict = {}

    def setup() -> dict:
        if not state:
            state["qkv"] = tuple(t.detach().clone().requires_grad_() for t in inp.qkv())
            g = torch.Generator().manual_seed(1)
            state["grad"] = torch.randn(s.B, s.h, s.T, s.d, generator=g).to(_DTYPES[s.dtype])
        return state

    def verify(grads) -> str:
        if "want" not in state:
            q, k, v = (t.detach().float().requires_grad_() for t in state["qkv"])
            with torch.enable_grad():
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                       is_causal=s.causal)
                state["want"] = torch.autograd.grad(out, (q, k, v), state["grad"].float())
        err = max(float((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30))
                  for a, b in zip(grads, state["want"], strict=True))
        if not err <= _TRAIN_TOL[s.dtype]:  # also catches NaN
            raise RuntimeError(f"wrong gradients: max |grad - SDPA fp32| / max |grad| = {err:.3g}")
        return f"max |grad - SDPA fp32| / max |grad| = {err:.1e}"

    def step(attend, note=None):
        def make():
            st = setup()
            q, k, v = st["qkv"]

            def fn():
                with torch.enable_grad():  # the harness times under no_grad
                    return torch.autograd.grad(attend(q, k, v), (q, k, v), st["grad"])
            if note:
                fn.note = note()
            fn()  # loads (or builds) the backward extension now, not in the first timed call
            if s.scores_bytes(1) <= _CHECK_MAX:
                fn.verify = verify
            return fn

        return make

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=s.causal)

    def ours(q, k, v):
        return mha.attention(q, k, v, causal=s.causal)

    def chosen():
        q, k, v = setup()["qkv"]
        return f"dispatch chose {mha.explain(q, k, v, causal=s.causal).chosen}"

    def teardown():
        state.clear()
        inp.clear()

    return Case(name=f"train B{s.B} h{s.h} T{s.T} d{s.d} {s.dtype} "
                     f"{'causal' if s.causal else 'dense'}",
                impls=[Impl("torch sdpa", step(sdpa)), Impl("mha auto", step(ours, chosen))],
                flops=3.5 * s.flops, metric="gflops", baseline="torch sdpa", peak=s.dtype,
                params=dict(B=s.B, h=s.h, T=s.T, d=s.d, dtype=s.dtype, causal=s.causal,
                            train=True),
                teardown=teardown)


def cases(ctx: Context) -> list[Case]:
    attn, modules = grid(ctx.quick)
    return ([attention_case(s, ctx) for s in attn] + [module_case(s, ctx) for s in modules]
            + [train_case(s, ctx) for s in train_grid(ctx.quick)])


__all__ = ["TITLE", "Shape", "grid", "train_grid", "cases", "attention_case", "module_case",
           "train_case"]
