"""mha.varlen_attention with score variants — a per-sequence bias list, softcap, sinks, ALiBi —
against the float64 per-head loop run on each sequence alone, in both strategies.

Shape legend: S sequences, N packed tokens, h / h_kv heads, d_k / d_v head dims,
n_q[s] / n_k[s] the lengths of sequence s.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mha
from mha.masks import causal_mask
from mha.varlen import varlen_attention

from oracle import FLOOR, max_err


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()])


def _per_sequence(q, k, v, n_q, n_k, causal, biases, upcast, **variants):
    """The seed-000 loop (:func:`mha.reference.attention`) on each sequence alone:
    ``(N_q, h, d_v)``, float64 when ``upcast``."""
    outs, iq, ik = [], 0, 0
    for s, (a, b) in enumerate(zip(n_q, n_k, strict=True)):
        qs = q[iq:iq + a].transpose(0, 1)[None]  # (a, h, d_k) -> (1, h, a, d_k)
        ks = k[ik:ik + b].transpose(0, 1)[None]  # (b, h_kv, d_k) -> (1, h_kv, b, d_k)
        vs = v[ik:ik + b].transpose(0, 1)[None]  # (b, h_kv, d_v) -> (1, h_kv, b, d_v)
        allowed = causal_mask(a, b)[None, None] if causal else None  # (1, 1, a, b)
        bias = None if biases is None else biases[s]
        out, _ = mha.reference.attention(qs, ks, vs, allowed=allowed, upcast=upcast,
                                         bias=bias, **variants)  # (1, h, a, d_v)
        outs.append(out[0].transpose(0, 1))  # (1, h, a, d_v) -> (a, h, d_v)
        iq, ik = iq + a, ik + b
    return torch.cat(outs)  # (N_q, h, d_v)


BIAS_SHAPES = {  # name -> bias[s]'s shape for a sequence of n_q = a queries, n_k = b keys
    "full": lambda h, a, b: (h, a, b),
    "per head": lambda h, a, b: (h, 1, 1),
    "per key": lambda h, a, b: (b,),
    "shared": lambda h, a, b: (1, a, b),
}


@st.composite
def packs(draw):
    S = draw(st.integers(1, 4))
    n_q = draw(st.lists(st.integers(0, 9), min_size=S, max_size=S))
    n_k = n_q if draw(st.booleans()) else draw(st.lists(st.integers(0, 9), min_size=S,
                                                         max_size=S))
    h_kv = draw(st.sampled_from([1, 2]))
    return n_q, n_k, h_kv * draw(st.sampled_from([1, 2])), h_kv


@pytest.mark.parametrize("strategy", ["pad", "loop", "auto"])
@given(pack=packs(), causal=st.booleans(), shape=st.sampled_from(sorted(BIAS_SHAPES)),
       softcap=st.sampled_from([None, 2.0]), sinks=st.booleans(), alibi=st.booleans(),
       seed=st.integers(0, 1000))
def test_bias_list_and_variants_equal_per_sequence_loop(strategy, pack, causal, shape, softcap,
                                                        sinks, alibi, seed):
    n_q, n_k, h, h_kv = pack
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(n_q), h, 8, generator=g)  # (N_q, h, d_k)
    k = torch.randn(sum(n_k), h_kv, 8, generator=g)  # (N_k, h_kv, d_k)
    v = torch.randn(sum(n_k), h_kv, 6, generator=g)  # (N_k, h_kv, d_v)
    biases = [torch.randn(*BIAS_SHAPES[shape](h, a, b), generator=g)
              for a, b in zip(n_q, n_k, strict=True)]
    variants = dict(softcap=softcap, sinks=torch.randn(h, generator=g) if sinks else None,
                    alibi_slopes=mha.alibi_slopes(h) if alibi else None)
    got = varlen_attention(q, k, v, _cu(n_q), _cu(n_k), causal=causal, strategy=strategy,
                           bias=biases, **variants)
    ref = _per_sequence(q, k, v, n_q, n_k, causal, biases, True, **variants)
    low = _per_sequence(q, k, v, n_q, n_k, causal, biases, False, **variants)
    assert got.shape == ref.shape
    assert max_err(got, ref) <= 2 * max_err(low, ref) + FLOOR[torch.float32]


@pytest.mark.parametrize("shape", sorted(BIAS_SHAPES))
@pytest.mark.parametrize("causal", [False, True])
def test_bias_gradients_equal_loop_in_both_strategies(shape, causal):
    """Each bias gets its own gradient, in its own (broadcast) shape, in both strategies."""
    n_q, n_k, h = [3, 0, 5, 2], [4, 2, 5, 1], 2
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(n_q), h, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(n_k), 1, 8, generator=g, dtype=torch.float64)
    v = torch.randn(sum(n_k), 1, 4, generator=g, dtype=torch.float64)
    shapes = [BIAS_SHAPES[shape](h, a, b) for a, b in zip(n_q, n_k, strict=True)]
    base = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
    slopes = mha.alibi_slopes(h).double()
    w = torch.randn(sum(n_q), h, 4, generator=g, dtype=torch.float64)
    grads = {}
    for name in ("pad", "loop", "oracle"):
        biases = [b.clone().requires_grad_(True) for b in base]
        if name == "oracle":
            out = _per_sequence(q, k, v, n_q, n_k, causal, biases, True, alibi_slopes=slopes)
        else:
            out = varlen_attention(q, k, v, _cu(n_q), _cu(n_k), causal=causal, strategy=name,
                                   bias=biases, alibi_slopes=slopes)
        gq, *gb = torch.autograd.grad((out * w).sum(), [q, *biases])
        grads[name] = (gq, gb)
    for name in ("pad", "loop"):
        gq, gb = grads[name]
        assert max_err(gq, grads["oracle"][0]) < 1e-10
        for s, (a, b) in enumerate(zip(gb, grads["oracle"][1], strict=True)):
            assert a.shape == shapes[s]
            assert max_err(a, b) < 1e-10, f"{name}: bias[{s}]"


def test_strategies_agree_with_a_bias():
    """The pad strategy's padded bias lines up with the right-aligned (causal, n_q != n_k) and
    the left-aligned layouts alike: both strategies give the same result."""
    n_q, n_k, h = [2, 7, 4], [5, 7, 6], 4
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, h, 8, generator=g) for n in (sum(n_q), sum(n_k), sum(n_k)))
    biases = [torch.randn(h, a, b, generator=g) for a, b in zip(n_q, n_k, strict=True)]
    for causal in (False, True):
        pad = varlen_attention(q, k, v, _cu(n_q), _cu(n_k), causal=causal, strategy="pad",
                               bias=biases)
        loop = varlen_attention(q, k, v, _cu(n_q), _cu(n_k), causal=causal, strategy="loop",
                                bias=biases)
        assert max_err(pad, loop) < 1e-5


def test_a_bias_changes_the_result():
    n, h = [3, 4], 2
    q = k = v = torch.randn(7, h, 8)
    plain = varlen_attention(q, k, v, _cu(n))
    biased = varlen_attention(q, k, v, _cu(n), bias=[torch.zeros(h, 3, 3),
                                                     torch.randn(h, 4, 4) * 3])
    assert max_err(biased[:3], plain[:3]) < 1e-5  # a zero bias is no bias (other backend)
    assert max_err(biased[3:], plain[3:]) > 1e-3


BIAS_REFUSALS = [
    (lambda h: torch.randn(h, 3, 3), TypeError, "bias must be a list of S=2 tensors"),
    (lambda h: [torch.randn(h, 1, 2)], ValueError, r"one tensor per sequence \(S=2\), got 1"),
    (lambda h: [torch.randn(h, 1, 2), torch.randn(h, 2, 2)], ValueError,
     r"bias\[0\] of shape \(2, 1, 2\) is not broadcastable to \(h, n_q\[s\], n_k\[s\]\) = "
     r"\(2, 1, 1\)"),
    (lambda h: [torch.randn(1, 1), torch.randn(3, 1, 1)], ValueError, r"bias\[1\]"),
    (lambda h: [torch.randn(1, 1), torch.randn(1, 1, 1, 1)], ValueError, r"bias\[1\]"),
    (lambda h: [torch.randn(1, 1), torch.ones(2, 2, dtype=torch.int64)], TypeError,
     r"bias\[1\] must be a floating tensor"),
    (lambda h: [torch.randn(1, 1), "zeros"], TypeError, r"bias\[1\] must be a floating"),
    (lambda h: "bias", TypeError, "bias must be a list"),
]


@pytest.mark.parametrize("make_bias,exc,pattern", BIAS_REFUSALS)
@pytest.mark.parametrize("strategy", ["pad", "loop"])
def test_bias_refusals_name_the_argument(make_bias, exc, pattern, strategy):
    h = 2
    q = k = v = torch.randn(3, h, 8)
    with pytest.raises(exc, match=pattern):
        varlen_attention(q, k, v, _cu([1, 2]), bias=make_bias(h), strategy=strategy)
