"""The ``variants`` suite: score variants and mask functions, mha against FlexAttention compiled,
SDPA with a materialized bias or mask, and eager torch; forward and forward + backward.

Shape legend: B batch, h heads, T sequence length (Tq = Tk = T), d head dim; n documents of
lengths len_1 ... len_n (sum T).

**Rows** (one case per row x shape x dtype x mode, named ``[train ]BxhxTxd dtype row``):

============================  ===============================================================
``plain`` / ``plain causal``  no variant: the cost references
``softcap 50``                ``s = 50 tanh(s / 50)``
``sinks``                     one sink logit per head ``(h,)`` in every softmax denominator
``alibi causal``              ``s -= slope_h (i - j)`` (the paper's slopes) under the causal mask,
                              as BLOOM and MPT use it (bidirectional, keys after the diagonal
                              gain up to slope_h T, which a bf16 bias cannot hold: its rounding
                              alone moved bf16 outputs by 1.4 at T = 1024)
``t5 bias``                   a float bias ``(1, h, T, T)``; a leaf with a gradient in training
``document n``                ``mha.mods.document``: n documents of seeded uneven lengths,
                              bidirectional within each; n = 8 everywhere, n = 2, 4, 16 in
                              fp32 forward (the cost should follow sum len_i^2)
``prefix-lm T/4``             ``mha.mods.prefix_lm(T // 4)``
``sliding window 512``        ``mha.mods.sliding_window(512)`` (causal)
============================  ===============================================================

**Implementations**: ``mha`` (``mha.attention`` with the variant's arguments; the note names
the backend ``mha.explain`` chose: ``flash_cpu`` for every row, the ``mask_mod`` rows walking
their block plans natively, where the kernel builds), ``flex compiled`` (``torch.compile(flex_attention)`` with a
``score_mod`` and/or a ``BlockMask``; sinks as one extra zero key whose score the ``score_mod``
replaces by the sink; compiled before timing and the compile time in the note; skipped with the
reason when compiling fails, in training (no FlexAttention backward on the CPU) and in
``--quick``), ``torch sdpa`` (``F.scaled_dot_product_attention`` with the variant materialized:
a float ``(1, h, T, T)`` bias for ALiBi and T5, a bool ``(T, T)`` mask for the mask functions,
an extra zero key with a ``(1, h, 1, T + 1)`` bias for sinks; softcap cannot be expressed:
skipped), ``eager torch`` (``softmax(q k^T * scale + bias) v`` written out; skipped with the
figure when the scores exceed ``--mem-budget``). The ratio column is against ``torch sdpa``.

**Checks** before timing: every output (in training the gradients of q, k, v and of the sinks
or the T5 bias) against the float64 reference (``mha`` backend ``reference``, head by head) up to
``_REF64_MAX`` score elements; above that the fp64 per-head loop would take the run's longest
time per case, so the big shapes are checked against eager torch in fp32 (head chunks, the
same formula in plain torch), and the check column says which.

**Targets** (reported, never asserted): in the forward every variant >= 2x FlexAttention
compiled and >= 3x SDPA with its materialized bias/mask; a variant costs <= 15 % more than plain
attention of the same sparsity (per kept score pair: score variants against ``plain``,
``document`` against ``plain``, the causal rows against ``plain causal``); the document rows'
time follows sum len_i^2 (within 15 % of proportional to the 2-document row); training rows
>= 2x SDPA. :func:`targets` turns the rows into the ``variants targets`` table: one row per
target and case (mha's time and rate; the ratio in the ratio column, > 1 better, the goal in
``params``; the note says met or missed) and one per target over all cases (the worst ratio,
how many cases met it, the geometric mean).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mha.bench.core import Case, Context, Impl, Row, Skip

TITLE = ("score variants and mask functions (softcap, sinks, ALiBi, T5 bias, document, "
         "prefix-LM, sliding window): mha vs FlexAttention compiled, SDPA with the variant "
         "materialized, eager torch; forward and forward + backward")
SUITE, TARGET_SUITE = "variants", "variants targets"
GiB = 2**30
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_TOL = {"fp32": 2e-4, "bf16": 3e-2}  # max |out - oracle| (unit-normal inputs)
_GRAD_TOL = {"fp32": 2e-4, "bf16": 5e-2}  # max |grad - oracle| / max |oracle grad|
_REF64_MAX = 2**24  # B*h*T*T up to which the oracle is the fp64 reference (else eager fp32)
_CHUNK = 2**23  # score elements per head chunk of the oracle (bounded memory)
SOFTCAP = 50.0


@dataclass(frozen=True)
class Variant:
    """One row of the suite: at most one score variant or one mask."""

    name: str
    softcap: float | None = None
    sinks: bool = False
    alibi: bool = False
    t5: bool = False
    mask: str | None = None  # causal | document | prefix | window
    docs: int = 0

    @property
    def plain(self) -> bool:
        return self.name.startswith("plain")


VARIANTS = (Variant("plain"), Variant("plain causal", mask="causal"),
            Variant("softcap 50", softcap=SOFTCAP), Variant("sinks", sinks=True),
            Variant("alibi causal", alibi=True, mask="causal"), Variant("t5 bias", t5=True),
            Variant("document 8", mask="document", docs=8),
            Variant("prefix-lm T/4", mask="prefix"),
            Variant("sliding window 512", mask="window"))
#: Extra document rows (fp32 forward): the cost against sum len_i^2 at a fixed T.
DOC_SCALING = tuple(Variant(f"document {n}", mask="document", docs=n) for n in (2, 4, 16))


@dataclass(frozen=True)
class Shape:
    B: int
    h: int
    T: int
    d: int
    window: int = 512  # the sliding window (tiny test shapes use a smaller one)

    @property
    def label(self) -> str:
        return f"{self.B}x{self.h}x{self.T}x{self.d}"


def grid(quick: bool) -> list[Shape]:
    return [Shape(1, 8, 1024, 64)] if quick else [Shape(1, 8, 4096, 64), Shape(1, 32, 2048, 128)]


def doc_lengths(T: int, n: int) -> list[int]:
    """``n`` seeded uneven document lengths summing to ``T`` (each between ~T/(3n) and ~2T/n)."""
    w = 0.5 + torch.rand(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    lengths = [max(1, int(T * x / float(w.sum()))) for x in w]
    lengths[-1] = T - sum(lengths[:-1])
    return lengths


def kept_pairs(s: Shape, v: Variant) -> int:
    """The (query, key) pairs the row's mask keeps, per batch row and head."""
    T, w, p = s.T, min(s.window, s.T), s.T // 4
    if v.mask == "causal":
        return T * (T + 1) // 2
    if v.mask == "window":  # query i sees min(i + 1, w) keys
        return w * (w + 1) // 2 + (T - w) * w
    if v.mask == "prefix":  # causal, plus the prefix keys after the diagonal
        return T * (T + 1) // 2 + p * (p - 1) // 2
    if v.mask == "document":
        return sum(n * n for n in doc_lengths(T, v.docs))
    return T * T


# ----------------------------------------------------------------------------- the variant's data
class _Data:
    """The tensors of one case (fp32 masters cast to the row's dtype), built on first use."""

    def __init__(self, s: Shape, v: Variant, dtype: str, train: bool):
        self.s, self.v, self.dtype, self.train = s, v, _DTYPES[dtype], train
        self.t: dict = {}

    def get(self) -> dict:
        if self.t:
            return self.t
        s, v, dt = self.s, self.v, self.dtype
        g = torch.Generator().manual_seed(0)
        qkv = [torch.randn(s.B, s.h, s.T, s.d, generator=g).to(dt)  # (B, h, T, d)
               for _ in range(3)]
        t = dict(q=qkv[0], k=qkv[1], v=qkv[2], sinks=None, slopes=None, bias=None, allowed=None)
        if v.sinks:
            t["sinks"] = torch.randn(s.h, generator=g)  # (h,) fp32
        if v.alibi:
            import mha

            t["slopes"] = mha.alibi_slopes(s.h)  # (h,) fp32
        if v.t5:
            t["bias"] = torch.randn(1, s.h, s.T, s.T, generator=g).to(dt)  # (1, h, T, T)
        if v.mask is not None:
            i = torch.arange(s.T)
            t["allowed"] = mask_fn(s, v)(i[:, None], i[None, :])  # (T, T), True = may attend
        if self.train:  # leaves of the step, shared by the implementations
            for name in ("q", "k", "v", "sinks", "bias"):
                if t[name] is not None:
                    t[name] = t[name].detach().requires_grad_()
            t["grad"] = torch.randn(s.B, s.h, s.T, s.d, generator=g).to(dt)  # (B, h, T, d)
        self.t = t
        return t

    def leaves(self) -> tuple:
        t = self.get()
        return tuple(t[n] for n in ("q", "k", "v", "sinks", "bias") if t[n] is not None)

    def clear(self) -> None:
        self.t = {}


def mask_fn(s: Shape, v: Variant):
    """``(q_idx, kv_idx) -> bool`` (True = may attend) written out here, independently of
    :mod:`mha.mods`: used by FlexAttention and materialized for SDPA, eager and the oracle."""
    T, w, p = s.T, s.window, s.T // 4
    if v.mask == "causal":
        return lambda qi, ki: ki <= qi
    if v.mask == "window":
        return lambda qi, ki: (ki <= qi) & (ki > qi - w)
    if v.mask == "prefix":
        return lambda qi, ki: (ki < p) | (ki <= qi)
    if v.mask == "document":
        ids = torch.repeat_interleave(torch.arange(v.docs), torch.tensor(doc_lengths(T, v.docs)))
        return lambda qi, ki: ids[qi] == ids[ki]  # (T,) document id per position
    return None


def _alibi_bias(slopes: torch.Tensor, T: int, dtype) -> torch.Tensor:
    """``(1, h, T, T)``: ``-slope_h (i - j)``, the ALiBi term materialized."""
    i = torch.arange(T, dtype=torch.float32)
    dist = i[:, None] - i[None, :]  # (T, T)
    return (-slopes.view(1, -1, 1, 1) * dist).to(dtype)  # (1, h, 1, 1) * (T, T) -> (1, h, T, T)


def mha_kwargs(s: Shape, v: Variant, t: dict) -> dict:
    """``mha.attention``'s arguments for the row (mask functions from :mod:`mha.mods`)."""
    from mha import mods

    kw: dict = {}
    if v.softcap is not None:
        kw["softcap"] = v.softcap
    for name, key in (("sinks", "sinks"), ("alibi_slopes", "slopes"), ("bias", "bias")):
        if t[key] is not None:
            kw[name] = t[key]
    if v.mask == "causal":
        kw["causal"] = True
    elif v.mask == "window":
        kw["mask_mod"] = mods.sliding_window(s.window)
    elif v.mask == "prefix":
        kw["mask_mod"] = mods.prefix_lm(s.T // 4)
    elif v.mask == "document":
        lengths = doc_lengths(s.T, v.docs)
        kw["mask_mod"] = mods.document(cu_seqlens=[0] + [sum(lengths[:i + 1])
                                                         for i in range(len(lengths))])
    return kw


def eager(q, k, v, *, softcap=None, bias=None, allowed=None, sinks=None):
    """``softmax(q k^T * scale + bias) v`` in plain torch, in the inputs' dtype (materializes
    the ``(B, h, T, T)`` scores). ``allowed`` ``(T, T)`` bool, ``sinks`` ``(h,)``."""
    B, h, T, d = q.shape
    # (B, h, T, d) @ (B, h, d, T) -> (B, h, T, T)
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias  # (1, h, T, T) broadcast
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.to(s.dtype).view(1, h, 1, 1).expand(B, h, T, 1)  # (B, h, T, 1)
        s = torch.cat([s, sink], dim=-1)  # (B, h, T, T + 1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]  # (B, h, T, T): the sink has no value
    return p @ v  # (B, h, T, T) @ (B, h, T, d) -> (B, h, T, d)


def _eager_args(v: Variant, t: dict, heads: slice | None = None, dtype=None) -> dict:
    """:func:`eager`'s arguments for the row: all heads (the leaves themselves, so gradients
    reach them), or the heads ``heads`` in ``dtype`` (the oracle's chunks)."""
    dtype = dtype or t["q"].dtype
    bias, sinks = t["bias"], t["sinks"]
    if heads is not None:
        bias = None if bias is None else bias[:, heads].to(dtype)
        sinks = None if sinks is None else sinks[heads]
    if t["slopes"] is not None:
        bias = _alibi_bias(t["slopes"][heads or slice(None)], t["q"].shape[2], dtype)
    return dict(softcap=v.softcap, bias=bias, allowed=t["allowed"], sinks=sinks)


def sdpa(v: Variant, t: dict):
    """SDPA with the variant materialized (see the module docstring); None for softcap."""
    if v.softcap is not None:
        return None
    q, k, val, sinks = t["q"], t["k"], t["v"], t["sinks"]
    bias = _eager_args(v, t)["bias"]
    if v.mask == "causal" and bias is None:
        return lambda: F.scaled_dot_product_attention(q, k, val, is_causal=True)
    if sinks is not None:
        B, h, T, d = q.shape

        def with_sink():  # one zero key whose score is the sink: bias (1, h, 1, T + 1)
            zero = k.new_zeros(B, h, 1, d)  # (B, h, 1, d)
            # (h,) -> (1, h, 1, 1) -> (1, h, 1, T + 1): zeros, then the sink
            bias = F.pad(sinks.to(q.dtype).view(1, h, 1, 1), (T, 0))
            return F.scaled_dot_product_attention(q, torch.cat([k, zero], 2),  # (B, h, T + 1, d)
                                                  torch.cat([val, zero], 2), attn_mask=bias)
        return with_sink
    if bias is not None and t["allowed"] is not None:  # (1, h, T, T): -inf where masked
        bias = bias.masked_fill(~t["allowed"], float("-inf"))
    mask = bias if bias is not None else t["allowed"]
    return lambda: F.scaled_dot_product_attention(q, k, val, attn_mask=mask)


def flex(s: Shape, v: Variant, t: dict):
    """``torch.compile(flex_attention)`` with the row's score_mod / BlockMask, compiled here."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        raise Skip(f"FlexAttention not in this torch: {e}") from e
    q, k, val, T = t["q"], t["k"], t["v"], s.T
    score_mod, block_mask = None, None
    if v.softcap is not None:
        cap = v.softcap
        score_mod = lambda sc, b, hh, qi, ki: cap * torch.tanh(sc / cap)  # noqa: E731
    elif t["slopes"] is not None:
        slopes = t["slopes"]
        score_mod = lambda sc, b, hh, qi, ki: sc - slopes[hh] * (qi - ki)  # noqa: E731
    elif t["bias"] is not None:
        bias = t["bias"]
        score_mod = lambda sc, b, hh, qi, ki: sc + bias[0, hh, qi, ki]  # noqa: E731
    elif t["sinks"] is not None:  # key T is a zero key; its score becomes the sink
        sinks = t["sinks"]
        zero = k.new_zeros(s.B, s.h, 1, s.d)  # (B, h, 1, d)
        k, val = torch.cat([k, zero], 2), torch.cat([val, zero], 2)  # (B, h, T + 1, d)
        score_mod = lambda sc, b, hh, qi, ki: torch.where(ki == T, sinks[hh], sc)  # noqa: E731
    fn = mask_fn(s, v)
    torch._dynamo.reset()  # a fresh compile per case (see mha.bench.peers.flex)
    t0 = time.perf_counter()
    try:
        if fn is not None:
            block_mask = create_block_mask(lambda b, hh, qi, ki: fn(qi, ki), None, None, T, T,
                                           device="cpu")
        compiled = torch.compile(flex_attention, dynamic=False)
        compiled(q, k, val, score_mod=score_mod, block_mask=block_mask)
    except Exception as e:  # noqa: BLE001 — inductor needs a working C++ toolchain
        line = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise Skip(f"torch.compile(flex_attention) failed: {type(e).__name__}: {line}") from e
    run = lambda: compiled(q, k, val, score_mod=score_mod, block_mask=block_mask)  # noqa: E731
    run.note = f"compiled in {time.perf_counter() - t0:.1f} s (untimed)"
    return run


# ----------------------------------------------------------------------------- the oracle
def _oracle(data: _Data) -> tuple[list[torch.Tensor], str]:
    """The expected output (forward) or gradients (training) as fp32 tensors, computed head
    chunk by head chunk; and the name of the oracle."""
    import mha

    s, v, t = data.s, data.v, data.get()
    fp64 = s.B * s.h * s.T * s.T <= _REF64_MAX
    wide = torch.float64 if fp64 else torch.float32
    step = max(1, _CHUNK // (s.B * s.T * s.T))
    parts: list[list[torch.Tensor]] = []
    for h0 in range(0, s.h, step):
        hs = slice(h0, min(s.h, h0 + step))
        q, k, val = (t[n].detach()[:, hs].to(wide).requires_grad_(data.train)
                     for n in ("q", "k", "v"))
        extra = {n: t[n].detach()[hs].float().to(wide).requires_grad_(data.train)
                 for n in ("sinks",) if t[n] is not None}
        if t["bias"] is not None:
            extra["bias"] = t["bias"].detach()[:, hs].to(wide).requires_grad_(data.train)
        with torch.enable_grad():
            if fp64:  # the seeds' per-head loop; the mask materialized from mask_fn
                out = mha.attention(q, k, val, backend="reference", softcap=v.softcap,
                                    sinks=extra.get("sinks"), bias=extra.get("bias"),
                                    alibi_slopes=None if t["slopes"] is None
                                    else t["slopes"][hs].to(wide), mask=t["allowed"])
            else:
                args = _eager_args(v, t, hs, wide)
                args.update((n, extra[n]) for n in extra)
                out = eager(q, k, val, **args)
            if data.train:
                got = torch.autograd.grad(out, (q, k, val, *extra.values()),
                                          t["grad"][:, hs].to(wide))
            else:
                got = (out,)
        parts.append([x.detach().float() for x in got])
    # reassemble the chunks: q, k, v, bias along heads (dim 1), sinks along dim 0
    names = ["q", "k", "v", *extra] if data.train else ["out"]
    full = [torch.cat([p[i] for p in parts], dim=0 if n == "sinks" else 1)
            for i, n in enumerate(names)]
    return full, ("fp64 reference" if fp64 else
                  "eager fp32 (the fp64 reference loop is too slow at this size)")


def _checked(make, data: _Data, state: dict):
    """Wrap an impl's ``make``: its first output is compared with the oracle (shared by the
    impls of the case, computed on first use)."""
    dtype = "fp32" if data.dtype == torch.float32 else "bf16"

    def verify(out) -> str:
        if "want" not in state:
            state["want"], state["what"] = _oracle(data)
        want, what = state["want"], state["what"]
        if not data.train:
            err = float((out.float() - want[0]).abs().max())
            if not err <= _TOL[dtype]:  # also catches NaN
                raise RuntimeError(f"wrong result: max |out - {what}| = {err:.3g} > {_TOL[dtype]}")
            return f"max |out - {what}| = {err:.1e}"
        err = max(float((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30))
                  for a, b in zip(out, want, strict=True))
        if not err <= _GRAD_TOL[dtype]:
            raise RuntimeError(f"wrong gradients: max |grad - {what}| / max |grad| = {err:.3g} "
                               f"> {_GRAD_TOL[dtype]}")
        return f"max |grad - {what}| / max |grad| = {err:.1e}"

    def build():
        fn = make()
        if data.train:
            forward = fn
            t = data.get()

            def fn():
                with torch.enable_grad():  # the harness times under no_grad
                    return torch.autograd.grad(forward(), data.leaves(), t["grad"])
            fn.note = getattr(forward, "note", "")
        fn.verify = verify
        return fn

    return build


# ----------------------------------------------------------------------------- cases
def case(s: Shape, v: Variant, dtype: str, train: bool, ctx: Context) -> Case:
    """One row of the suite at one shape, dtype and mode: its four implementations."""
    import mha

    data = _Data(s, v, dtype, train)
    state: dict = {}
    itemsize = _DTYPES[dtype].itemsize
    scores = s.B * s.h * s.T * (s.T + 1) * itemsize

    def budget(need: float, what: str):
        if need > ctx.mem_budget:
            raise Skip(f"would need {need / GiB:.1f} GiB for {what} (memory budget "
                       f"{ctx.mem_budget / GiB:.0f} GiB, --mem-budget)")

    def make_mha():
        t = data.get()
        kw = mha_kwargs(s, v, t)
        fn = lambda: mha.attention(t["q"], t["k"], t["v"], **kw)  # noqa: E731
        with torch.set_grad_enabled(train):  # dispatch weighs whether a gradient is needed
            chosen = mha.explain(t["q"], t["k"], t["v"], **kw).chosen
        fn.note = f"dispatch chose {chosen}"
        return fn

    def make_flex():
        if train:
            raise Skip("FlexAttention has no backward on the CPU (torch "
                       f"{torch.__version__.split('+')[0]}: NotImplementedError)")
        if ctx.quick:
            raise Skip("not in --quick: torch.compile takes ~5-80 s per case here")
        return flex(s, v, data.get())

    def make_sdpa():
        fn = sdpa(v, data.get())
        if fn is None:
            raise Skip("SDPA cannot express a softcap (a function of the score, not a bias)")
        t = data.get()
        what = ("a (1, h, T, T) float bias, -inf where masked" if v.alibi and v.mask else
                "a (1, h, T, T) float bias" if v.t5 or v.alibi else
                "is_causal, nothing materialized" if v.mask == "causal" else
                "a (T, T) bool mask" if t["allowed"] is not None else
                "an extra zero key, bias (1, h, 1, T + 1)" if v.sinks else "no bias")
        fn.note = f"materialized: {what}"
        return fn

    def make_eager():
        # scores, softmax, temporaries; the backward adds the two score-sized gradients
        k = 3 + (v.softcap is not None) + (v.t5 or v.alibi) + (2 if train else 0)
        budget(k * scores, "the (B, h, T, T) scores")
        t = data.get()
        args = _eager_args(v, t)
        return lambda: eager(t["q"], t["k"], t["v"], **args)

    def teardown():
        data.clear()
        state.clear()

    kept = kept_pairs(s, v)
    flops = 4.0 * s.B * s.h * kept * s.d * (3.5 if train else 1.0)  # two matmuls; training 3.5x
    params = dict(B=s.B, h=s.h, T=s.T, d=s.d, dtype=dtype, variant=v.name, train=train,
                  kept=kept, window=s.window, causal=v.mask in ("causal", "prefix", "window"))
    if v.mask == "document":
        params.update(docs=v.docs, sum_len2=kept)
    shown = f"sliding window {s.window}" if v.mask == "window" else v.name
    name = f"{'train ' if train else ''}{s.label} {dtype} {shown}"
    impls = [Impl(n, _checked(m, data, state)) for n, m in
             (("mha", make_mha), ("flex compiled", make_flex), ("torch sdpa", make_sdpa),
              ("eager torch", make_eager))]
    return Case(name=name, impls=impls, flops=flops, metric="gflops", baseline="torch sdpa",
                peak=dtype, params=params, teardown=teardown)


def all_cases(ctx: Context, shapes: list[Shape] | None = None) -> list[Case]:
    """Every case (``shapes`` overrides the grid: tests use a tiny one)."""
    out = []
    for s in grid(ctx.quick) if shapes is None else shapes:
        for train in (False, True):
            for dtype in _DTYPES:
                rows = VARIANTS + (DOC_SCALING if dtype == "fp32" and not train else ())
                out += [case(s, v, dtype, train, ctx) for v in rows]
    return out


# ----------------------------------------------------------------------------- targets
_LIMIT = 1 / 1.15  # "<= 15 % more" as a ratio (reference time / time) >= 1 / 1.15


def targets(rows: list[Row]) -> list[Row]:
    """The ``variants targets`` rows computed from the suite's rows (see the module docstring):
    per target and case, ``ratio`` > 1 is better and ``note`` says met or missed; then per
    target the worst case."""
    got: dict = {}
    for r in rows:
        if r.suite == SUITE and r.ok:
            p = r.params
            got[(p["B"], p["h"], p["T"], p["d"], p["dtype"], p["train"], p["variant"],
                 r.impl)] = r

    def t(r: Row, variant: str, impl: str) -> Row | None:
        p = r.params
        return got.get((p["B"], p["h"], p["T"], p["d"], p["dtype"], p["train"], variant, impl))

    out: list[Row] = []

    def add(label: str, mine: Row, ratio: float, goal: float, how: str):
        met = ratio >= goal
        out.append(Row(suite=TARGET_SUITE, case=mine.case, impl=label, seconds=mine.seconds,
                       flops=mine.flops, ratio=ratio, params=dict(mine.params, goal=goal),
                       note=f"{'met' if met else 'MISSED'}: {how}; mha's {mine.note}"))

    for r in rows:
        if (r.suite != SUITE or r.impl != "mha" or not r.ok
                or r.params["variant"].startswith("plain")):
            continue
        p, name = r.params, r.params["variant"]
        peers = [("flex compiled", 2.0), ("torch sdpa", 3.0)] if not p["train"] else \
            [("torch sdpa", 2.0)]
        for impl, goal in peers:
            other = t(r, name, impl)
            if other is not None:
                ratio = other.seconds / r.seconds
                add(f"mha vs {impl} >= {goal:g}x", r, ratio, goal, f"{ratio:.2f}x {impl}")
        ref_name = "plain causal" if p["causal"] else "plain"
        plain = t(r, ref_name, "mha")
        if plain is not None:  # time per kept pair against the plain row's
            ratio = plain.seconds * (p["kept"] / plain.params["kept"]) / r.seconds
            add("mha <= 15 % over plain", r, ratio, _LIMIT,
                f"{100 * (1 / ratio - 1):+.0f} % per kept pair vs mha {ref_name}")
        if name.startswith("document") and p["docs"] != 2:
            two = t(r, "document 2", "mha")
            if two is not None:  # time per sum len_i^2 against the 2-document row's
                ratio = two.seconds * (p["sum_len2"] / two.params["sum_len2"]) / r.seconds
                add("mha document ~ sum len^2", r, ratio, _LIMIT,
                    f"{100 * (1 / ratio - 1):+.0f} % vs proportional to the 2-document row "
                    f"(sum len^2 {p['sum_len2']:,} vs {two.params['sum_len2']:,})")
    for label in dict.fromkeys(x.impl for x in list(out)):
        mine = [x for x in out if x.impl == label]
        worst = min(mine, key=lambda x: x.ratio)
        n_met = sum(x.ratio >= x.params["goal"] for x in mine)
        gmean = math.exp(sum(math.log(x.ratio) for x in mine) / len(mine))
        out.append(Row(suite=TARGET_SUITE, case="all cases: the worst", impl=label,
                       seconds=worst.seconds, flops=worst.flops, ratio=worst.ratio,
                       params=dict(goal=worst.params["goal"], met=n_met, of=len(mine),
                                   geomean=gmean, worst=worst.case),
                       note=f"met in {n_met} of {len(mine)}; geometric mean {gmean:.2f}; "
                            f"worst: {worst.case}"))
    return out


def run(ctx: Context) -> list[Row]:
    """Measure every selected case, then add the target rows."""
    rows: list[Row] = []
    for c in all_cases(ctx):
        if not ctx.selected(c.name):
            continue
        got = ctx.measure(c, suite=SUITE)
        rows += got
        if ctx.on_row is not None:
            for r in got:
                ctx.on_row(r)
    return rows + targets(rows)


__all__ = ["TITLE", "SUITE", "TARGET_SUITE", "Variant", "VARIANTS", "DOC_SCALING", "Shape",
           "grid", "doc_lengths", "kept_pairs", "mask_fn", "mha_kwargs", "eager", "sdpa", "flex",
           "case", "all_cases", "targets", "run"]
