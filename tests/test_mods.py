"""mask_mod / score_mod (mha.mods) and block plans (mha.blockplan): plans against the dense mask
their function gives, attention with a mask function against attention with its materialized
mask and against the float64 oracle (tests/oracle.py's rule), gradients, FlexAttention.

Shape legend: B batch, h / h_kv heads, Tq / Tk lengths, d head dim, bq / bk block sizes.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mha
from mha import mods
from mha.backends import all_backends
from mha.masks import causal_mask, window_mask

from oracle import FLOOR, assert_within_budget, max_err

MOD_BACKENDS = [b.name for b in all_backends() if "mask_mod" in b.caps.mask_kinds]
SCORE_BACKENDS = [b.name for b in all_backends() if b.caps.score_mod]


def _qkv(B, h, h_kv, Tq, Tk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, h, Tq, d, generator=g).to(dtype),
            torch.randn(B, h_kv, Tk, d, generator=g).to(dtype),
            torch.randn(B, h_kv, Tk, d, generator=g).to(dtype))


def _dense(mod, B, h, Tq, Tk) -> torch.Tensor:
    """The bound function on every index at once, expanded to (B, h, Tq, Tk): the ground truth."""
    f = mods.bind(mod, B, Tq, Tk)
    r = f(torch.arange(B).view(-1, 1, 1, 1), torch.arange(h).view(1, -1, 1, 1),
          torch.arange(Tq).view(1, 1, -1, 1), torch.arange(Tk).view(1, 1, 1, -1))
    return r.expand(B, h, Tq, Tk)


def _split(draw, T):
    cuts = sorted(draw(st.lists(st.integers(0, T), max_size=4)))
    return torch.tensor([0, *cuts, T])


@st.composite
def _mod(draw, B, T, depth=0):
    """A random built-in, or an and/or composition of two."""
    kind = draw(st.sampled_from(["causal", "window", "document", "doc_ids", "prefix", "chunked"]
                                + (["and", "or"] if depth < 1 else [])))
    if kind == "causal":
        return mods.causal()
    if kind == "window":
        return mods.sliding_window(draw(st.integers(1, T + 2)))
    if kind == "document":
        return mods.document(cu_seqlens=_split(draw, T))
    if kind == "doc_ids":
        ids = draw(st.lists(st.lists(st.integers(0, 2), min_size=T, max_size=T),
                            min_size=B, max_size=B))
        return mods.document(doc_ids=torch.tensor(ids))
    if kind == "prefix":
        return mods.prefix_lm(torch.tensor(draw(st.lists(st.integers(0, T), min_size=B,
                                                          max_size=B))))
    if kind == "chunked":
        return mods.chunked(draw(st.integers(1, T + 1)))
    a, b = draw(_mod(B, T, depth + 1)), draw(_mod(B, T, depth + 1))
    return mods.and_masks(a, b) if kind == "and" else mods.or_masks(a, b)


def _expected_states(dense, bq, bk):
    """FULL / PARTIAL / EMPTY of each (query block, key block), from the dense mask."""
    B, h, Tq, Tk = dense.shape
    out = {}
    for qb in range(0, Tq, bq):
        for kb in range(0, Tk, bk):
            blk = dense[:, :, qb:qb + bq, kb:kb + bk]
            out[qb // bq, kb // bk] = blk.all(-1).all(-1), blk.any(-1).any(-1)  # (B, h) each
    return out


@given(data=st.data(), B=st.integers(1, 2), T=st.integers(1, 24), extra_q=st.integers(-3, 3),
       bq=st.integers(1, 9), bk=st.integers(1, 9))
def test_plan_matches_the_dense_mask(data, B, T, extra_q, bq, bk):
    Tq, Tk = max(1, T + extra_q), T
    mod = data.draw(_mod(B, T))
    plan = mha.block_plan(mod, B, 3, Tq, Tk, block_q=bq, block_k=bk)
    dense = _dense(mod, B, 3, Tq, Tk)
    assert torch.equal(plan.materialize().expand(B, 3, Tq, Tk), dense)
    for (qb, kb), (all_, any_) in _expected_states(dense, bq, bk).items():
        for b in range(B):
            full, part = plan.blocks(b if plan.B > 1 else 0, 0, qb)
            assert (kb in full.tolist()) == bool(all_[b, 0])
            assert (kb in part.tolist()) == bool(any_[b, 0] and not all_[b, 0])


def test_builtins_say_what_their_docstrings_say():
    B, Tq, Tk = 2, 5, 9
    c = _dense(mods.causal(), 1, 1, Tq, Tk)[0, 0]
    assert torch.equal(c, causal_mask(Tq, Tk))  # bottom-right, like causal=True
    w = _dense(mods.sliding_window(3), 1, 1, Tq, Tk)[0, 0]
    assert torch.equal(w, causal_mask(Tq, Tk) & window_mask(Tq, Tk, 3))
    doc = _dense(mods.document(cu_seqlens=[0, 4, 9]), 1, 1, 9, 9)[0, 0]
    ids = torch.tensor([0] * 4 + [1] * 5)
    assert torch.equal(doc, ids[:, None] == ids[None, :])
    pre = _dense(mods.prefix_lm(torch.tensor([3, 0])), B, 1, 6, 6)[:, 0]
    for b, n in enumerate([3, 0]):
        want = torch.tensor([[j < n or j <= i for j in range(6)] for i in range(6)])
        assert torch.equal(pre[b], want)
    ch = _dense(mods.chunked(4), 1, 1, 10, 10)[0, 0]
    want = torch.tensor([[j <= i and i // 4 == j // 4 for j in range(10)] for i in range(10)])
    assert torch.equal(ch, want)


def test_plans_keep_b_and_h_at_one_unless_the_function_reads_them():
    assert (mha.block_plan(mods.causal(), 3, 4, 8, 8, block_q=4, block_k=4).B,) == (1,)
    p = mha.block_plan(mods.prefix_lm(torch.tensor([1, 2, 3])), 3, 4, 8, 8)
    assert (p.B, p.h) == (3, 1)
    p = mha.block_plan(lambda b, h, q, kv: (kv <= q) | (h == 0), 3, 4, 8, 8)
    assert (p.B, p.h) == (1, 4)
    assert p.materialize().shape == (1, 4, 8, 8)


def test_plans_are_cached_by_parameters_and_contents():
    cu = torch.tensor([0, 30, 64])
    a = mha.block_plan(mods.document(cu_seqlens=cu), 1, 2, 64, 64, block_q=16, block_k=16)
    b = mha.block_plan(mods.document(cu_seqlens=cu.clone()), 1, 2, 64, 64, block_q=16,
                       block_k=16)
    c = mha.block_plan(mods.document(cu_seqlens=torch.tensor([0, 31, 64])), 1, 2, 64, 64,
                       block_q=16, block_k=16)
    d = mha.block_plan(mods.document(cu_seqlens=cu), 1, 2, 64, 64, block_q=16, block_k=32)
    assert a is b and a is not c and a is not d
    f = mods.causal()
    assert mha.block_plan(f, 1, 1, 8, 8, cache=False) is not mha.block_plan(f, 1, 1, 8, 8)


def test_repr_prints_the_sparsity():
    p = mha.block_plan(mods.document(cu_seqlens=[0, 64, 128]), 1, 1, 128, 128, block_q=32,
                       block_k=32)
    # 4 x 4 blocks: two 2 x 2 full diagonal squares, the rest empty
    assert "16 blocks: full 50.0%, partial 0.0%, empty 50.0%" in repr(p)


class _Counting:
    """A causal document mask that records every (q_idx, kv_idx) block it is called on."""

    def __init__(self, ids):
        self.ids, self.seen = ids, []

    def __call__(self, b, h, q_idx, kv_idx):
        qi, kj = torch.broadcast_tensors(q_idx, kv_idx)  # every (query, key) pair evaluated
        self.seen.append((qi.flatten().clone(), kj.flatten().clone()))
        return (self.ids[q_idx] == self.ids[kv_idx]) & (kv_idx <= q_idx)


@pytest.mark.parametrize("backend", ["blocksparse"])
def test_full_and_empty_blocks_never_call_the_mask(backend):
    ids = torch.tensor([0] * 40 + [1] * 24 + [2] * 32)  # T = 96, blocks of 16
    fn = _Counting(ids)
    plan = mha.block_plan(fn, 1, 2, 96, 96, block_q=16, block_k=16)
    assert plan.counts["full"] and plan.counts["empty"] and plan.counts["partial"]
    fn.seen.clear()
    q, k, v = _qkv(1, 2, 2, 96, 96, 16)
    from mha.blocksparse import block_sparse_attention
    out = block_sparse_attention(q, k, v, plan, scale=0.25)
    plan.materialize()
    assert fn.seen, "the partial blocks must be evaluated"
    partial = {(qb, kb) for qb in range(6) for kb in plan.blocks(0, 0, qb)[1].tolist()}
    for qi, kj in fn.seen:
        assert set(zip((qi // 16).tolist(), (kj // 16).tolist(), strict=True)) <= partial
    dense = _dense(fn, 1, 2, 96, 96)
    assert_within_budget(out, q, k, v, dense, 0.25)


@pytest.mark.parametrize("backend", MOD_BACKENDS)
@given(data=st.data(), Tq=st.integers(1, 20), Tk=st.integers(1, 20), kv=st.sampled_from([1, 2]),
       causal=st.booleans(), window=st.one_of(st.none(), st.integers(1, 6)),
       lengths=st.booleans(), with_mask=st.booleans())
def test_attention_with_a_mask_function_equals_its_materialized_mask(
        backend, data, Tq, Tk, kv, causal, window, lengths, with_mask):
    B, h = 2, 4
    mod = data.draw(_mod(B, Tk))
    q, k, v = _qkv(B, h, kv, Tq, Tk, 16, seed=Tq * 31 + Tk)
    kl = torch.tensor([Tk, max(0, Tk - 5)]) if lengths else None
    window = window if causal else None
    m = torch.rand(B, 1, Tq, Tk, generator=torch.Generator().manual_seed(1)) > 0.3 \
        if with_mask else None
    out = mha.attention(q, k, v, mask_mod=mod, causal=causal, window=window, key_lengths=kl,
                        mask=m, backend=backend)
    allowed = _dense(mod, B, h, Tq, Tk)
    if causal:
        allowed = allowed & causal_mask(Tq, Tk)
    if window:
        allowed = allowed & window_mask(Tq, Tk, window)
    if kl is not None:
        allowed = allowed & (torch.arange(Tk) < kl[:, None])[:, None, None, :]
    if m is not None:
        allowed = allowed & m
    assert_within_budget(out, q, k, v, allowed)
    same = mha.attention(q, k, v, mask=allowed, backend="math")
    torch.testing.assert_close(out, same, rtol=0, atol=1e-5)


def _score_oracle(q, k, v, allowed, scale, score_mod, upcast):
    """The dense formula with a score_mod, written out here (float64 when ``upcast``)."""
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    B, h, Tq, _ = q.shape
    g = h // k.shape[1]
    kh, vh = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # (B, h, Tk, d)
    s = q @ kh.transpose(-2, -1) * scale  # (B, h, Tq, Tk)
    Tk = s.shape[-1]
    s = score_mod(s, torch.arange(B).view(-1, 1, 1, 1), torch.arange(h).view(1, -1, 1, 1),
                  torch.arange(Tq).view(1, 1, -1, 1), torch.arange(Tk).view(1, 1, 1, -1)).to(q.dtype)
    a = allowed.expand_as(s)
    w = torch.softmax(s.masked_fill(~a, float("-inf")), -1).nan_to_num(0.0)  # empty rows: 0
    return w @ vh


def _softcap_alibi(score, b, h, q_idx, kv_idx):
    return 5.0 * torch.tanh(score / 5.0) - 0.25 * (h + 1) * (q_idx - kv_idx).abs()


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 4, 2, 9, 9), (1, 2, 1, 5, 13), (1, 2, 2, 13, 5)])
def test_score_mod_matches_the_oracle(backend, dtype, shape):
    B, h, h_kv, Tq, Tk = shape
    q, k, v = _qkv(B, h, h_kv, Tq, Tk, 16, dtype)
    doc = mods.and_masks(mods.document(cu_seqlens=[0, Tk // 2, Tk]), mods.causal())
    out = mha.attention(q, k, v, mask_mod=doc, score_mod=_softcap_alibi, backend=backend)
    allowed = _dense(doc, B, h, Tq, Tk)
    ref = _score_oracle(q, k, v, allowed, 0.25, _softcap_alibi, True)
    low = _score_oracle(q, k, v, allowed, 0.25, _softcap_alibi, False)
    assert max_err(out, ref) <= 2 * max_err(low, ref) + FLOOR[dtype]
    # the score_mod is not a no-op here (the test can fail)
    plain = mha.attention(q, k, v, mask_mod=doc, backend=backend)
    assert max_err(plain, ref) > 10 * (2 * max_err(low, ref) + FLOOR[dtype])


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
def test_gradients_match_the_materialized_mask(backend):
    q, k, v = (t.double().requires_grad_() for t in _qkv(2, 4, 2, 11, 14, 8))
    bias = torch.randn(4, 1, 1, dtype=torch.float64, requires_grad=True)  # learned, per head
    prefix = mods.prefix_lm(torch.tensor([2, 6]))

    def score_mod(s, b, h, qi, kj):
        return s + bias[h.flatten()].view(1, -1, 1, 1) * (kj - qi)

    out = mha.attention(q, k, v, mask_mod=prefix, score_mod=score_mod, backend=backend)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, bias))
    ref = _score_oracle(q, k, v, _dense(prefix, 2, 4, 11, 14), 8 ** -0.5, score_mod, True)
    want = torch.autograd.grad(ref.square().sum(), (q, k, v, bias))
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


def test_rows_with_no_key_are_zero_with_finite_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 1, 6, 4, 16))  # Tq > Tk
    out = mha.attention(q, k, v, mask_mod=mods.causal())  # rows 0, 1 see no key
    out.sum().backward()
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_a_score_mod_stays_on_blocksparse_and_explain_says_why():
    q, k, v = _qkv(1, 2, 2, 40, 40, 32)
    ex = mha.explain(q, k, v, mask_mod=mods.causal(), score_mod=_softcap_alibi)
    reasons = {e.backend: "; ".join(e.reasons) for e in ex}
    assert ex.chosen == "blocksparse"
    assert "mask kind 'mask_mod' not supported" in reasons["flash_decode"]
    assert "mask kind" not in reasons["flash_cpu"]  # it walks plans; the score_mod is the reason
    assert "score_mod not supported" in reasons["flash_cpu"]
    assert "arbitrary Python function" in reasons["flash_cpu"]
    assert mha.explain(q, k, v, mask_mod=mods.causal()).chosen == "flash_cpu"
    plain = next(e for e in mha.explain(q, k, v) if e.backend == "blocksparse")
    assert plain.ok and "no mask_mod / score_mod" in plain.defers


def test_return_weights_goes_to_the_reference():
    q, k, v = _qkv(1, 2, 2, 7, 7, 16)
    out, w = mha.attention(q, k, v, mask_mod=mods.sliding_window(2), return_weights=True)
    assert torch.equal(w[0, 0] > 0, causal_mask(7, 7) & window_mask(7, 7, 2))
    assert_within_budget(out, q, k, v, causal_mask(7, 7) & window_mask(7, 7, 2))


def test_flex_attention_agrees_on_a_tiny_case():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = _qkv(1, 2, 2, 16, 16, 16)
    ids = torch.tensor([0] * 5 + [1] * 7 + [2] * 4)

    def doc_causal(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx)

    def score_mod(s, b, h, q_idx, kv_idx):
        return s - 0.1 * (q_idx - kv_idx)

    try:
        bm = fa.create_block_mask(doc_causal, None, None, 16, 16, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex warns that it is unfused
            want = fa.flex_attention(q, k, v, block_mask=bm, score_mod=score_mod)
    except Exception as e:  # noqa: BLE001 -- eager flex on CPU is optional
        pytest.skip(f"FlexAttention's eager mode does not run here: {type(e).__name__}: {e}")
    got = mha.attention(q, k, v, mask_mod=doc_causal, score_mod=score_mod)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("backend", MOD_BACKENDS)
def test_a_nan_in_another_document_never_reaches_a_row(backend):
    from oracle import rule_oracle

    q, k, v = _qkv(1, 2, 2, 12, 12, 16)
    k[0, 0, 2] = float("nan")  # key 2: document 0
    v[0, 1, 3] = float("inf")  # value 3: document 0
    doc = mods.document(cu_seqlens=[0, 5, 12])
    out = mha.attention(q, k, v, mask_mod=doc, backend=backend)
    want = rule_oracle(q, k, v, _dense(doc, 1, 2, 12, 12))
    assert torch.isfinite(out[:, :, 5:]).all()  # document 1 never sees keys 2, 3
    torch.testing.assert_close(out[:, :, 5:].double(), want[:, :, 5:], rtol=0, atol=1e-5)
