"""mha.varlen_attention: packed sequences against the float64 loop, one sequence at a time.

Shape legend: S sequences, N packed tokens, h / h_kv heads, d_k / d_v head dims.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mha
from mha.masks import causal_mask
from mha.varlen import _choose, varlen_attention

from oracle import FLOOR, max_err, naive, oracle


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()])


def _packed(n_q, n_k, h, h_kv, d_k, d_v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(n_q), h, d_k, generator=g).to(dtype)  # (N_q, h, d_k)
    k = torch.randn(sum(n_k), h_kv, d_k, generator=g).to(dtype)  # (N_k, h_kv, d_k)
    v = torch.randn(sum(n_k), h_kv, d_v, generator=g).to(dtype)  # (N_k, h_kv, d_v)
    return q, k, v


def _per_sequence(fn, q, k, v, n_q, n_k, causal):
    """``fn(q_s, k_s, v_s, allowed)`` per sequence on (1, h, n, d) tensors, concatenated."""
    outs, iq, ik = [], 0, 0
    for a, b in zip(n_q, n_k, strict=True):
        qs = q[iq:iq + a].transpose(0, 1)[None]  # (1, h, a, d_k)
        ks = k[ik:ik + b].transpose(0, 1)[None]  # (1, h_kv, b, d_k)
        vs = v[ik:ik + b].transpose(0, 1)[None]  # (1, h_kv, b, d_v)
        allowed = causal_mask(a, b)[None, None] if causal else None  # (1, 1, a, b)
        outs.append(fn(qs, ks, vs, allowed)[0][0].transpose(0, 1))  # (a, h, d_v)
        iq, ik = iq + a, ik + b
    return torch.cat(outs)  # (N_q, h, d_v)


@st.composite
def packs(draw):
    S = draw(st.integers(1, 5))
    n_q = draw(st.lists(st.integers(0, 19), min_size=S, max_size=S))
    same = draw(st.booleans())
    n_k = n_q if same else draw(st.lists(st.integers(0, 19), min_size=S, max_size=S))
    h_kv = draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 2]))
    d_k = draw(st.sampled_from([16, 32]))
    d_v = draw(st.sampled_from([d_k, 16, 24]))
    return n_q, n_k, h, h_kv, d_k, d_v, same


@pytest.mark.parametrize("strategy", ["pad", "loop", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(pack=packs(), causal=st.booleans())
def test_matches_the_oracle_sequence_by_sequence(strategy, dtype, pack, causal):
    n_q, n_k, h, h_kv, d_k, d_v, same = pack
    q, k, v = _packed(n_q, n_k, h, h_kv, d_k, d_v, dtype)
    cu_k = None if same else _cu(n_k)
    got = varlen_attention(q, k, v, _cu(n_q), cu_k, causal=causal, strategy=strategy)
    assert got.shape == (sum(n_q), h, d_v) and got.dtype == dtype
    ref = _per_sequence(oracle, q, k, v, n_q, n_k, causal)
    low = _per_sequence(naive, q, k, v, n_q, n_k, causal)
    budget = 2 * max_err(low, ref) + FLOOR[dtype]
    assert max_err(got, ref) <= budget


def test_tokens_never_see_another_sequence():
    n = [4, 6]
    q, k, v = _packed(n, n, 2, 2, 16, 16, torch.float32)
    base = varlen_attention(q, k, v, _cu(n))
    k2, v2 = k.clone(), v.clone()
    k2[4:] += 5.0  # change only the second sequence's keys and values
    v2[4:] -= 3.0
    moved = varlen_attention(q, k2, v2, _cu(n))
    assert torch.equal(moved[:4], base[:4])
    assert not torch.allclose(moved[4:], base[4:])


@pytest.mark.parametrize("causal", [False, True])
def test_pad_and_loop_have_the_same_gradients(causal):
    n_q, n_k = [3, 9, 0, 5], [6, 9, 2, 5]
    ins = _packed(n_q, n_k, 4, 2, 16, 24, torch.float32, seed=3)
    go = torch.randn(sum(n_q), 4, 24, generator=torch.Generator().manual_seed(1))
    grads = {}
    for strategy in ("pad", "loop"):
        leaves = [t.clone().requires_grad_() for t in ins]
        out = varlen_attention(*leaves, _cu(n_q), _cu(n_k), causal=causal, strategy=strategy)
        grads[strategy] = torch.autograd.grad((out * go).sum(), leaves)
    ref_in = [t.double().requires_grad_() for t in ins]
    ref = _per_sequence(oracle, *ref_in, n_q, n_k, causal)
    want = torch.autograd.grad((ref * go.double()).sum(), ref_in)
    for a, b, w in zip(grads["pad"], grads["loop"], want, strict=True):
        assert torch.isfinite(a).all()
        assert max_err(a, w) < 1e-4 and max_err(b, w) < 1e-4


def test_cost_model_pads_even_lengths_and_loops_skewed_ones():
    assert _choose([128] * 8, [128] * 8, 8 * 128) == "pad"
    assert _choose([4096] + [8] * 50, [4096] + [8] * 50, 8 * 128) == "loop"
    assert _choose([7], [7], 64) == "loop"  # one sequence: a view, nothing to pad


def test_empty_pack_and_empty_sequences():
    q, k, v = _packed([0], [0], 2, 2, 16, 16, torch.float32)
    assert varlen_attention(q, k, v, _cu([0])).shape == (0, 2, 16)
    q, k, v = _packed([3, 0], [0, 4], 2, 2, 16, 16, torch.float32)
    out = varlen_attention(q, k, v, _cu([3, 0]), _cu([0, 4]))
    assert torch.equal(out, torch.zeros(3, 2, 16))  # the first sequence has no key


@pytest.mark.parametrize("cu, match", [
    (torch.tensor([0.0, 3.0]), "integer tensor"),
    (torch.tensor([[0, 3]]), r"shape \(S \+ 1,\)"),
    (torch.tensor([1, 3]), "start at 0"),
    (torch.tensor([0, 4, 3]), "never decrease"),
    (torch.tensor([0, 2]), "end at the token count 3"),
])
def test_bad_offsets_are_named(cu, match):
    q, k, v = _packed([3], [3], 2, 2, 16, 16, torch.float32)
    with pytest.raises((TypeError, ValueError), match=match) as e:
        varlen_attention(q, k, v, cu)
    assert "cu_seqlens_q" in str(e.value)


def test_other_bad_arguments():
    q, k, v = _packed([3], [5], 2, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens_k is needed"):
        varlen_attention(q, k, v, _cu([3]))
    with pytest.raises(ValueError, match="same number of sequences"):
        varlen_attention(q, k, v, _cu([3]), _cu([2, 3]))
    with pytest.raises(ValueError, match="strategy must be one of"):
        varlen_attention(q, k, v, _cu([3]), _cu([5]), strategy="fast")
    with pytest.raises(ValueError, match=r"q must have shape \(N_q, h, d_k\)"):
        varlen_attention(q[None], k, v, _cu([3]), _cu([5]))


def test_exported_from_the_package():
    assert mha.varlen_attention is varlen_attention


@pytest.mark.parametrize("causal", [False, True])
def test_module_on_a_packed_row_equals_one_call_per_sequence(causal):
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    lengths = [5, 11, 1, 7]
    x = torch.randn(1, sum(lengths), 32)  # (1, N, d_model): four sequences end to end
    packed = m(x, cu_seqlens=_cu(lengths), causal=causal)  # (1, N, d_model)
    parts, i = [], 0
    for n in lengths:
        parts.append(m(x[:, i:i + n], causal=causal))  # (1, n, d_model)
        i += n
    assert packed.shape == x.shape
    assert max_err(packed, torch.cat(parts, dim=1)) < 1e-5


def test_module_packed_refusals():
    m = mha.MultiHeadAttention(32, 4)
    x, cu = torch.randn(1, 6, 32), _cu([2, 4])
    with pytest.raises(ValueError, match=r"one packed row \(1, N, d_model\)"):
        m(torch.randn(2, 6, 32), cu_seqlens=cu)
    with pytest.raises(ValueError, match="self-attention only"):
        m(x, x, x, cu_seqlens=cu)
    with pytest.raises(ValueError, match="mask, key_lengths and cache must be None"):
        m(x, cu_seqlens=cu, key_lengths=torch.tensor([6]))
    with pytest.raises(ValueError, match="need_weights"):
        m(x, cu_seqlens=cu, need_weights=True)
