"""Score variants (softcap, sinks, bias, ALiBi) through every backend that declares them,
against the float64 per-head loop with the tolerance rule of ``oracle.py``; their gradients;
and against the formulas of the models that need them (Gemma 2, gpt-oss, BLOOM).

Shape legend: B batch, h / h_kv heads, Tq / Tk lengths, d_k / d_v head dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mha
from mha import reference
from mha.backends import ORDER
from mha.masks import MaskSpec

from oracle import FLOOR, max_err

VARIANT_ARGS = ("softcap", "sinks", "bias", "alibi_slopes")


def _within_budget(got, ref, low, dtype, what):
    """The rule of oracle.py on precomputed tensors: error vs float64 <= 2x naive + floor."""
    budget = 2.0 * max_err(low, ref) + FLOOR[dtype]
    err = max_err(got, ref)
    assert err <= budget, f"{what}: error {err:.3e} > budget {budget:.3e}"


@dataclass(frozen=True)
class Sizes:
    """The ranges :func:`calls` draws a call's sizes and values from (the defaults: a few
    tokens, every backend's small-shape path)."""

    max_len: int = 7  # Tq and Tk from 1 to this
    d_k: tuple[int, ...] = (4, 8)
    d_v: tuple[int, ...] = (4, 6)
    groups: tuple[int, ...] = (1, 2)  # query heads per key/value head
    max_window: int = 4
    keep: float = 0.7  # the share of a random mask's pairs that may attend
    softcaps: tuple[float, ...] = (0.5, 2.0, 30.0)


@st.composite
def calls(draw, dtypes=(torch.float32,), sizes: Sizes = Sizes()):
    """q, k, v (GQA, Tq != Tk, some non-contiguous) with a drawn mix of masks and a non-empty
    set of variants, of ``sizes``."""
    dtype = draw(st.sampled_from(dtypes))
    B = draw(st.integers(1, 2))
    h_kv = draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from(sizes.groups))
    Tq, Tk = draw(st.integers(1, sizes.max_len)), draw(st.integers(1, sizes.max_len))
    d_k, d_v = draw(st.sampled_from(sizes.d_k)), draw(st.sampled_from(sizes.d_v))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    if draw(st.booleans()):  # (B, Tq, h, d) memory read as (B, h, Tq, d): non-contiguous
        q = rand(B, Tq, h, d_k).transpose(1, 2)
    else:
        q = rand(B, h, Tq, d_k)
    k, v = rand(B, h_kv, Tk, d_k), rand(B, h_kv, Tk, d_v)
    masks = {}
    if draw(st.booleans()):
        masks["causal"] = True
        if draw(st.booleans()):
            masks["window"] = draw(st.integers(1, sizes.max_window))
    if draw(st.booleans()):
        masks["key_lengths"] = torch.tensor([draw(st.integers(0, Tk)) for _ in range(B)])
    if draw(st.booleans()):  # may empty whole rows
        masks["mask"] = torch.rand(B, 1, Tq, Tk, generator=g) < sizes.keep
    variants = {}
    chosen = draw(st.sets(st.sampled_from(VARIANT_ARGS), min_size=1))
    if "softcap" in chosen:
        variants["softcap"] = draw(st.sampled_from(sizes.softcaps))
    if "sinks" in chosen:
        variants["sinks"] = rand(h) * 2
    if "bias" in chosen:
        shape = draw(st.sampled_from([(B, h, Tq, Tk), (1, h, Tq, Tk), (h, 1, Tk), (Tk,),
                                      (B, 1, Tq, 1)]))
        variants["bias"] = rand(*shape)
    if "alibi_slopes" in chosen:
        variants["alibi_slopes"] = (mha.alibi_slopes(h).to(dtype) if draw(st.booleans())
                                    else rand(B, h).abs())
    return q, k, v, masks, variants


def _allowed(q, k, masks):
    """The dense bool mask of ``masks`` (None when nothing is masked)."""
    B, h, Tq, _ = q.shape
    spec = MaskSpec(masks.get("causal", False), masks.get("key_lengths"), masks.get("mask"),
                    masks.get("window"))
    return spec.materialize(B, h, Tq, k.shape[2])


def _capable(q, k, v, **kwargs):
    return [v_.backend for v_ in mha.explain(q, k, v, **kwargs) if v_.ok]


@given(case=calls(dtypes=(torch.float32, torch.bfloat16)))
def test_every_capable_backend_matches_the_float64_loop(case):
    q, k, v, masks, variants = case
    allowed = _allowed(q, k, masks)
    ref, ref_w = reference.attention(q, k, v, allowed=allowed, upcast=True, **variants)
    low, low_w = reference.attention(q, k, v, allowed=allowed, **variants)
    capable = _capable(q, k, v, **masks, **variants)
    assert {"math", "reference"} <= set(capable)
    assert ("sdpa" in capable) == ("softcap" not in variants and "sinks" not in variants)
    for name in capable:
        out = mha.attention(q, k, v, backend=name, **masks, **variants)
        _within_budget(out, ref, low, q.dtype, f"{name} output")
    for name in ("math", "reference"):
        _, w = mha.attention(q, k, v, backend=name, return_weights=True, **masks, **variants)
        _within_budget(w, ref_w, low_w, q.dtype, f"{name} weights")


def _grads(fn, tensors):
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*tensors)
    g = torch.Generator().manual_seed(1)
    out.backward(torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype))
    return [t.grad for t in tensors]


def differentiable(q, k, v, masks, variants):
    """``(names, inputs, run)``: the variants that take a gradient (sinks, bias), the tensors
    to differentiate (q, k, v, then those), and ``run(backend=None, upcast=False)`` giving
    ``fn(q, k, v, *those) -> out`` through a backend, or the float64 loop when backend is
    None."""
    allowed = _allowed(q, k, masks)
    names = [n for n in ("sinks", "bias") if n in variants]
    fixed = {n: t for n, t in variants.items() if n not in names}

    def run(backend=None, upcast=False):
        def fn(q, k, v, *diff):
            kw = dict(zip(names, diff, strict=True))
            if backend is None:
                return reference.attention(q, k, v, allowed=allowed, upcast=upcast,
                                           **fixed, **kw)[0]
            return mha.attention(q, k, v, backend=backend, **masks, **fixed, **kw)
        return fn

    return names, [q, k, v, *(variants[n] for n in names)], run


@given(case=calls())
def test_gradients_of_q_k_v_sinks_and_bias_match_float64_autograd(case):
    q, k, v, masks, variants = case
    names, inputs, run = differentiable(q, k, v, masks, variants)
    ref = _grads(run(upcast=True), [t.double() for t in inputs])
    low = _grads(run(), inputs)
    for backend in [b for b in ("math", "sdpa") if b in _capable(q, k, v, **masks, **variants)]:
        got = _grads(run(backend), inputs)
        for what, a, r, lo in zip(["q", "k", "v", *names], got, ref, low, strict=True):
            assert a.shape == r.shape, f"{backend} grad {what}: shape {a.shape} != {r.shape}"
            assert torch.isfinite(a).all(), f"{backend} grad {what} not finite"
            _within_budget(a, r, lo, q.dtype, f"{backend} grad {what}")


@pytest.mark.parametrize("bias_shape", [(1, 2, 3, 4), (2, 1, 4)])
def test_gradcheck_of_the_reference_with_sinks_and_broadcast_bias(bias_shape):
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)

    q, k, v = rand(1, 2, 3, 3), rand(1, 2, 4, 3), rand(1, 2, 4, 2)
    sinks, bias = rand(2), rand(*bias_shape)
    allowed = torch.rand(1, 1, 3, 4, generator=g) < 0.8
    allowed[0, 0, 1] = False  # a row with no key: a sink-only row

    def fn(q, k, v, sinks, bias):
        return mha.attention(q, k, v, mask=allowed, softcap=3.0, sinks=sinks, bias=bias,
                             alibi_slopes=mha.alibi_slopes(2).double(), backend="reference")

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks, bias))


@pytest.mark.parametrize("backend", ["math", "reference"])
def test_rows_with_no_key_give_zeros_and_finite_grads_even_with_a_sink(backend):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g, requires_grad=True) for _ in range(3))
    sinks = torch.randn(2, generator=g, requires_grad=True)
    bias = torch.randn(2, 3, 3, generator=g, requires_grad=True)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 1, :] = False  # query 1 may attend nothing
    out, w = mha.attention(q, k, v, mask=mask, sinks=sinks, bias=bias, softcap=1.0,
                           backend=backend, return_weights=True)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert torch.equal(w[:, :, 1], torch.zeros_like(w[:, :, 1]))
    out.sum().backward()
    for t in (q, k, v, sinks, bias):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, 1], torch.zeros_like(q.grad[:, :, 1]))
    assert torch.equal(bias.grad[:, 1], torch.zeros_like(bias.grad[:, 1]))  # never read


def test_weights_exclude_the_sink():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    _, w = mha.attention(q, k, v, sinks=sinks, return_weights=True, backend="math")
    s = q @ k.transpose(-2, -1) / 2.0  # (1, 2, 3, 3), scale 1/sqrt(4)
    mass = s.exp().sum(-1)  # (1, 2, 3)
    torch.testing.assert_close(w.sum(-1), mass / (mass + sinks.exp()[None, :, None]))


def test_dropout_leaves_the_returned_weights_alone():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 4, 8, generator=g) for _ in range(3))
    kw = dict(sinks=torch.randn(2, generator=g), bias=torch.randn(4, 4, generator=g),
              alibi_slopes=mha.alibi_slopes(2), softcap=5.0, causal=True, return_weights=True)
    _, w_plain = mha.attention(q, k, v, backend="math", **kw)
    out, w = mha.attention(q, k, v, backend="math", dropout_p=0.5, **kw)
    torch.testing.assert_close(w, w_plain)
    assert out.shape == (2, 2, 4, 8)


@pytest.mark.parametrize("backend", ["sdpa", "math", "reference", "flash_cpu"])
def test_a_masked_pairs_nan_bias_is_never_read(backend):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 16, generator=g) for _ in range(3))
    bias = torch.randn(1, 2, 4, 4, generator=g)
    allowed = torch.ones(4, 4, dtype=torch.bool).tril()
    poisoned = bias.masked_fill(~allowed, float("nan")).requires_grad_(True)
    clean = bias.masked_fill(~allowed, 0.0)
    out = mha.attention(q, k, v, causal=True, bias=poisoned, backend=backend)
    torch.testing.assert_close(out, mha.attention(q, k, v, causal=True, bias=clean,
                                                  backend="reference"))
    out.sum().backward()
    assert torch.isfinite(poisoned.grad).all()
    assert not poisoned.grad[..., ~allowed].any()


def test_dispatch_and_explain_give_the_reasons():
    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))  # prefill: past the decode kernel
    for variant in (dict(bias=torch.zeros(40, 40)), dict(softcap=10.0, sinks=torch.zeros(2)),
                    dict(alibi_slopes=mha.alibi_slopes(2))):
        ex = mha.explain(q, k, v, **variant)
        assert ex.chosen == "flash_cpu", variant  # native in the kernel
    ex = mha.explain(q[:, :, :1], k, v, softcap=10.0, sinks=torch.zeros(2))  # a decode step
    assert ex.chosen == "flash_decode"
    ex = mha.explain(q, k, v, softcap=10.0, sinks=torch.zeros(2))
    sdpa = next(x for x in ex if x.backend == "sdpa")
    assert any(r.startswith("softcap") for r in sdpa.reasons)
    assert any(r.startswith("sinks") for r in sdpa.reasons)
    with pytest.raises(mha.BackendError, match="softcap"):
        mha.attention(q, k, v, softcap=10.0, backend="sdpa")
    assert set(ORDER) == {x.backend for x in ex}


# The models' own formulas (transformers' eager attention), on small examples.

class _Stub(torch.nn.Module):
    """The attributes transformers' eager_attention_forward reads off its module."""

    def __init__(self, head_dim: int, groups: int, sinks: torch.Tensor | None = None):
        super().__init__()
        self.head_dim, self.num_key_value_groups = head_dim, groups
        if sinks is not None:
            self.sinks = torch.nn.Parameter(sinks)
        self.training = False


def _causal_additive(Tq, Tk):
    allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
    return torch.zeros(Tq, Tk).masked_fill(~allowed, float("-inf"))[None, None]  # (1,1,Tq,Tk)


def test_softcap_matches_gemma2_eager_attention():
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2",
                                 reason="transformers not installed")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) * 3 for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA: 2 K/V heads
    bias = torch.randn(2, 1, 5, 5, generator=g)  # a float mask is a bias after the cap
    mask = _causal_additive(5, 5) + bias
    want, want_w = gemma2.eager_attention_forward(_Stub(8, 2), q, k, v, mask, scaling=8 ** -0.5,
                                                  softcap=1.5)
    for backend in ("math", "reference"):
        out, w = mha.attention(q, k, v, causal=True, bias=bias, softcap=1.5, backend=backend,
                               return_weights=True)
        torch.testing.assert_close(out, want.transpose(1, 2))  # (B, Tq, h, d) -> (B, h, Tq, d)
        torch.testing.assert_close(w, want_w)


def test_sinks_match_gpt_oss_eager_attention():
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss",
                                  reason="transformers not installed")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 8, generator=g)
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    sinks = torch.randn(4, generator=g)
    with torch.no_grad():
        want, want_w = gpt_oss.eager_attention_forward(_Stub(8, 2, sinks), q, k, v,
                                                       _causal_additive(3, 6), scaling=0.3)
    for backend in ("math", "reference"):
        out, w = mha.attention(q, k, v, causal=True, sinks=sinks, scale=0.3, backend=backend,
                               return_weights=True)
        torch.testing.assert_close(out, want.transpose(1, 2))
        torch.testing.assert_close(w, want_w)


def test_alibi_slopes_are_the_papers_and_blooms():
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom",
                                reason="transformers not installed")
    for n in (1, 2, 3, 5, 8, 12, 16, 24, 40):
        # BLOOM's bias is slope * j for key position j: its value at j = 1 is the slope
        theirs = bloom.build_alibi_tensor(torch.ones(1, 4), n, torch.float32)[:, 0, 1]
        torch.testing.assert_close(mha.alibi_slopes(n), theirs)  # both round 2^x to float32
    n = 8  # a power of two: the geometric sequence 2^(-8 k / n), k = 1..n
    want = torch.tensor([2.0 ** (-8 * k / n) for k in range(1, n + 1)])
    torch.testing.assert_close(mha.alibi_slopes(n), want, rtol=0, atol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_softmax_equals_blooms_under_a_mask(causal):
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom",
                                reason="transformers not installed")
    g = torch.Generator().manual_seed(0)
    B, h, Tq, Tk = 2, 4, 3, 6
    q = torch.randn(B, h, Tq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, h, Tk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    positions = torch.ones(B, Tk)
    bias = bloom.build_alibi_tensor(positions, h, torch.float64).view(B, h, 1, Tk)  # slope*j
    mask = torch.rand(B, 1, Tq, Tk, generator=g) < 0.8
    mask[..., -1] = True
    slopes = mha.alibi_slopes(h).double()
    ours = mha.attention(q, k, v, causal=causal, mask=mask, alibi_slopes=slopes)
    theirs = mha.attention(q, k, v, causal=causal, mask=mask, bias=bias)
    torch.testing.assert_close(ours, theirs)


def test_alibi_distance_is_bottom_right_aligned():
    q = torch.zeros(1, 1, 2, 4, dtype=torch.float64)  # all scores 0: the weights show ALiBi
    k, v = torch.zeros(1, 1, 5, 4, dtype=torch.float64), torch.eye(5, 4, dtype=torch.float64)[None, None]
    slope = torch.tensor([math.log(2.0)], dtype=torch.float64)  # each step back halves
    _, w = mha.attention(q, k, v, causal=True, alibi_slopes=slope, return_weights=True)
    last = w[0, 0, -1]  # the last query sits at key 4: weights 1, 2, 4, 8, 16 (normalized)
    torch.testing.assert_close(last / last[0], torch.tensor([1.0, 2, 4, 8, 16], dtype=torch.float64))
    assert w[0, 0, 0, -1] == 0  # the first query sits at key 3 (causal, bottom right)


# varlen_attention and the decode entry point

@pytest.mark.parametrize("causal", [True, False])
def test_varlen_variants_match_one_call_per_sequence(causal):
    g = torch.Generator().manual_seed(0)
    n_q, n_k = [2, 5, 1], [4, 5, 3]
    q = torch.randn(sum(n_q), 4, 8, generator=g)
    k, v = torch.randn(sum(n_k), 2, 8, generator=g), torch.randn(sum(n_k), 2, 8, generator=g)
    cu_q = torch.tensor([0, 2, 7, 8])
    cu_k = torch.tensor([0, 4, 9, 12])
    kw = dict(softcap=2.0, sinks=torch.randn(4, generator=g), alibi_slopes=mha.alibi_slopes(4),
              causal=causal)
    want, iq, ik = [], 0, 0
    for a, b in zip(n_q, n_k, strict=True):
        qs = q[iq:iq + a].transpose(0, 1)[None]  # (1, h, a, d)
        ks, vs = (t[ik:ik + b].transpose(0, 1)[None] for t in (k, v))  # (1, h_kv, b, d)
        out = reference.attention(qs, ks, vs, allowed=mha.causal_mask(a, b) if causal else None,
                                  upcast=True, softcap=2.0, sinks=kw["sinks"],
                                  alibi_slopes=kw["alibi_slopes"])[0]
        want.append(out[0].transpose(0, 1).float())  # (a, h, d)
        iq, ik = iq + a, ik + b
    want = torch.cat(want)  # (N_q, h, d)
    for strategy in ("pad", "loop"):
        got = mha.varlen_attention(q, k, v, cu_q, cu_k, strategy=strategy, **kw)
        torch.testing.assert_close(got, want, msg=strategy)


def test_decode_entry_point_serves_the_variants():
    from mha.ops.decode import flash_decode

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 16, generator=g)
    k, v = torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    kw = dict(softcap=3.0, sinks=torch.randn(4, generator=g), bias=torch.randn(4, 1, 9, generator=g),
              alibi_slopes=mha.alibi_slopes(4), key_lengths=torch.tensor([9, 5]))
    with torch.no_grad():
        got = flash_decode(q, k, v, **kw)
        want = mha.attention(q, k, v, backend="reference", **kw)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["sdpa", "math", "reference"])
def test_a_nan_in_a_masked_key_never_reaches_a_row_with_variants(backend):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    kw = dict(bias=torch.randn(2, 4, 4, generator=g), alibi_slopes=mha.alibi_slopes(2))
    if backend != "sdpa":
        kw.update(softcap=2.0, sinks=torch.randn(2, generator=g))
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, 3], v_bad[:, :, 3] = float("nan"), float("inf")  # key 3: only the last row sees it
    out = mha.attention(q, k_bad, v_bad, causal=True, backend=backend, **kw)
    clean = mha.attention(q, k, v, causal=True, backend="reference", **kw)
    torch.testing.assert_close(out[:, :, :3], clean[:, :, :3])
    assert out[:, :, 3].isnan().all()  # the row that may attend the NaN key: IEEE says NaN
