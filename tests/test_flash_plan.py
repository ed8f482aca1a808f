"""mask_mod calls walked natively by the flash kernel through their block plans (48-row x
128-key blocks; ``csrc/common/block_plan.h``): forward and fused backward against the float64
loop with the tolerance rule of ``oracle.py``, at shapes that cross the kernel's blocks, composed
with causal / window / key_lengths / a bool mask and with the score variants.

Shape legend: B batch, h / h_kv heads, Tq / Tk lengths, d head dim.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mha
from mha import mods, reference
from mha.ops import flash
from test_flash_bwd import _cancellation
from test_mods import _Counting, _dense, _mod
from test_variants import _allowed
from threads import with_threads

from oracle import FLOOR, max_err

pytestmark = pytest.mark.skipif(flash.unavailable() is not None,
                                reason=f"native kernel unavailable: {flash.unavailable()}")


def _rand(shape, dtype, g):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _case(B, h, h_kv, Tq, Tk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (_rand((B, h, Tq, d), dtype, g), _rand((B, h_kv, Tk, d), dtype, g),
            _rand((B, h_kv, Tk, d), dtype, g))


def _expected(q, k, mod, masks):
    """The dense mask of ``mod`` AND the call's other masks, (B, h, Tq, Tk)."""
    B, h, Tq, _ = q.shape
    Tk = k.shape[2]
    allowed = _dense(mod, B, h, Tq, Tk)
    other = _allowed(q, k, masks)
    return allowed if other is None else allowed & other


def _check_forward(q, k, v, mod, masks=None, variants=None):
    masks, variants = masks or {}, variants or {}
    allowed = _expected(q, k, mod, masks)
    ref, _ = reference.attention(q, k, v, allowed=allowed, upcast=True, **variants)
    low, _ = reference.attention(q, k, v, allowed=allowed, **variants)
    out = mha.attention(q, k, v, mask_mod=mod, backend="flash_cpu", **masks, **variants)
    budget = 2 * max_err(low, ref) + FLOOR[q.dtype]
    err = max_err(out, ref)
    assert err <= budget, f"flash_cpu with a plan: error {err:.3e} > budget {budget:.3e}"
    return out


BUILTINS = {
    "causal": lambda T: mods.causal(),
    "sliding_window": lambda T: mods.sliding_window(70),
    "document": lambda T: mods.document(cu_seqlens=[0, T // 5, T // 2, T // 2 + 3, T]),
    "doc_ids": lambda T: mods.document(doc_ids=torch.arange(T) // 97),
    "prefix_lm": lambda T: mods.prefix_lm(torch.tensor([T // 3, 5])),
    "chunked": lambda T: mods.chunked(64),
    "and": lambda T: mods.and_masks(mods.document(cu_seqlens=[0, T // 2, T]), mods.causal()),
    "or": lambda T: mods.or_masks(mods.chunked(50), mods.sliding_window(20)),
    "lambda_h": lambda T: (lambda b, h, q, kv: ((q - kv).abs() < 30 + 40 * h) | (kv < 4)),
    "lambda_checker": lambda T: (lambda b, h, q, kv: ((q // 7 + kv // 5) % 3) != 0),
    "nothing": lambda T: (lambda b, h, q, kv: kv < 0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(BUILTINS))
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 300), (2, 2, 1, 100, 333), (2, 3, 3, 261, 140)])
def test_every_builtin_and_lambda_matches_the_float64_loop(name, dtype, shape):
    B, h, h_kv, Tq, Tk = shape
    q, k, v = _case(B, h, h_kv, Tq, Tk, 32, dtype, seed=Tq + Tk)
    mod = BUILTINS[name](Tk)
    assert mha.explain(q, k, v, mask_mod=mod).chosen == "flash_cpu"
    _check_forward(q, k, v, mod)


@st.composite
def plan_calls(draw, dtypes=(torch.float32, torch.bfloat16), max_len=300):
    """q, k, v (GQA, Tq != Tk, non-contiguous q), a drawn mask_mod, other masks and variants."""
    dtype = draw(st.sampled_from(dtypes))
    B, h_kv = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 2]))
    Tq, Tk = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = (_rand((B, Tq, h, 32), dtype, g).transpose(1, 2) if draw(st.booleans())
         else _rand((B, h, Tq, 32), dtype, g))
    k, v = _rand((B, h_kv, Tk, 32), dtype, g), _rand((B, h_kv, Tk, 16), dtype, g)
    mod = draw(_mod(B, Tk))
    masks = {}
    if draw(st.booleans()):
        masks["causal"] = True
        if draw(st.booleans()):
            masks["window"] = draw(st.integers(1, 150))
    if draw(st.booleans()):
        masks["key_lengths"] = torch.tensor([draw(st.integers(0, Tk)) for _ in range(B)])
    if draw(st.booleans()):
        masks["mask"] = torch.rand(B, 1, Tq, Tk, generator=g) < 0.8
    variants = {}
    for name in draw(st.sets(st.sampled_from(["softcap", "sinks", "bias", "alibi_slopes"]))):
        if name == "softcap":
            variants[name] = draw(st.sampled_from([0.5, 5.0]))
        elif name == "sinks":
            variants[name] = _rand((h,), dtype, g) * 2
        elif name == "bias":
            variants[name] = _rand((1, h, Tq, Tk), dtype, g)
        else:
            variants[name] = mha.alibi_slopes(h).to(dtype)
    return q, k, v, mod, masks, variants


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=plan_calls())
def test_plans_compose_with_masks_and_variants(case):
    q, k, v, mod, masks, variants = case
    _check_forward(q, k, v, mod, masks, variants)


def _grads(fn, tensors, seed=1):
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*tensors)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed),
                     dtype=torch.float64).to(out.dtype)
    out.backward(go)
    return [t.grad for t in tensors], go, out.detach()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=plan_calls(max_len=200))
def test_the_fused_backward_with_a_plan_matches_float64_autograd(case):
    q, k, v, mod, masks, variants = case
    allowed = _expected(q, k, mod, masks)
    fixed = {n: t for n, t in variants.items() if n not in ("sinks", "bias")}
    names = [n for n in ("sinks", "bias") if n in variants]

    def run(backend=None, upcast=False):
        def fn(q, k, v, *diff):
            kw = dict(zip(names, diff, strict=True))
            if backend is None:
                return reference.attention(q, k, v, allowed=allowed, upcast=upcast, **fixed,
                                           **kw)[0]
            return mha.attention(q, k, v, mask_mod=mod, backend=backend, **masks, **fixed, **kw)
        return fn

    inputs = [q, k, v, *(variants[n] for n in names)]
    ref, go, out = _grads(run(upcast=True), [t.double() for t in inputs])
    low = _grads(run(), inputs)[0]
    got = _grads(run("flash_cpu"), inputs)[0]
    size = max(1.0, _cancellation(q, k, go, out, q.shape[-1] ** -0.5))
    for what, a, r, lo in zip(["q", "k", "v", *names], got, ref, low, strict=True):
        assert torch.isfinite(a).all(), f"grad {what} not finite"
        budget = 2 * max_err(lo, r) + FLOOR[q.dtype] * max(size, r.abs().max().item())
        err = max_err(a, r)
        assert err <= budget, f"flash_cpu grad {what}: error {err:.3e} > budget {budget:.3e}"


def test_the_fused_backward_equals_the_pytorch_backward_with_a_plan():
    if flash.load_backward() is not None:
        pytest.skip(f"fused backward unavailable: {flash.load_backward()}")
    q, k, v = _case(2, 4, 2, 170, 290, 32, torch.float32)
    mod = mods.and_masks(mods.document(cu_seqlens=[0, 100, 130, 290]),
                         lambda b, h, qi, kv: (qi + kv + h) % 5 != 0)
    index, bits = mha.block_plan(mod, 2, 4, 170, 290, block_q=48, block_k=128).kernel_tensors()
    assert index.shape[1] == 4 and bits.shape[0] > 0  # per head, with partial blocks
    out, _ = flash.flash_attention(q, k, v, causal=True, plan=(index, bits))
    lse = torch.ops.mha.flash_attention_fwd(q, k, v, None, None, True, 32 ** -0.5, 0, 0.0, None,
                                            None, None, index, bits)[1]
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    args = (go, None, q, k, v, out, lse, None, None, True, 32 ** -0.5, 0, 0.0, None, None, None,
            False, index, bits)
    fused = torch.ops.mha.flash_attention_bwd_fused(*args)
    ref = flash.flash_attention_bwd_torch(*args)
    for what, a, b in zip(("dq", "dk", "dv"), fused[:3], ref[:3], strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=what)


def test_the_callable_is_evaluated_once_per_plan_and_never_by_the_kernel():
    ids = torch.tensor([0] * 300 + [1] * 84)  # T = 384: 8 x 3 blocks of 48 x 128, causal
    fn = _Counting(ids)
    q, k, v = (t.requires_grad_() for t in _case(1, 2, 2, 384, 384, 16, torch.float32))
    out = mha.attention(q, k, v, mask_mod=fn, backend="flash_cpu")
    pairs = torch.cat([torch.stack([qi, kj]) for qi, kj in fn.seen], 1)  # (2, evaluated)
    assert pairs.shape[1] == 384 * 384  # building the plan: every pair once, none twice
    assert torch.unique(pairs[0] * 384 + pairs[1]).numel() == 384 * 384
    plan = mha.block_plan(fn, 1, 2, 384, 384, block_q=48, block_k=128)
    assert plan.counts["full"] and plan.counts["empty"] and plan.counts["partial"]
    fn.seen.clear()
    out = mha.attention(q, k, v, mask_mod=fn, backend="flash_cpu")  # the cached plan
    out.sum().backward()
    assert fn.seen == []  # neither the forward nor the backward calls it: the bits are cached
    dense = _dense(fn, 1, 2, 384, 384)[0, 0]
    index, bits = plan.kernel_tensors()
    for qb in range(8):
        for kb in range(3):
            e = int(index[0, 0, qb, kb])
            blk = dense[qb * 48:(qb + 1) * 48, kb * 128:(kb + 1) * 128]
            if e >= 0:
                assert torch.equal(bits[e], blk) and not blk.all() and blk.any()
            else:
                assert bool(blk.all()) == (e == -1) and bool(blk.any()) == (e == -1)


def test_rows_with_no_key_are_zeros_with_finite_gradients():
    q, k, v = (t.requires_grad_() for t in _case(1, 4, 2, 200, 150, 32, torch.float32))
    mod = mods.and_masks(mods.causal(), lambda b, h, qi, kv: qi % 3 != 0)  # Tq > Tk
    out, lse = mha.attention(q, k, v, mask_mod=mod, backend="flash_cpu", return_lse=True)
    empty = torch.zeros(200, dtype=torch.bool)
    empty[:50] = True  # above the bottom-right diagonal
    empty[::3] = True  # the lambda's rows
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    assert torch.isinf(lse[:, :, empty]).all() and torch.isfinite(lse[:, :, ~empty]).all()
    (out.square().sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[:, :, empty], torch.zeros_like(q.grad[:, :, empty]))


def test_training_with_a_mask_mod_dispatches_to_the_kernel():
    q, k, v = (t.requires_grad_() for t in _case(1, 2, 2, 96, 96, 16, torch.float32))
    doc = mods.document(cu_seqlens=[0, 40, 96])
    assert mha.explain(q, k, v, mask_mod=doc).chosen == "flash_cpu"
    assert mha.explain(q.detach(), k.detach(), v.detach(), mask_mod=doc,
                       score_mod=lambda s, b, h, qi, kv: s).chosen == "blocksparse"
    assert mha.explain(q.double(), k.double(), v.double(), mask_mod=doc).chosen == "blocksparse"


def test_the_kernel_refuses_a_bad_plan_by_name():
    q, k, v = _case(1, 2, 2, 60, 200, 16, torch.float32)
    op = torch.ops.mha.flash_attention_fwd
    index = torch.full((1, 1, 2, 2), -1, dtype=torch.int32)
    bits = torch.zeros(1, 48, 128, dtype=torch.bool)
    op(q, k, v, None, None, False, 0.25, 0, 0.0, None, None, None, index, bits)
    with pytest.raises(RuntimeError, match="plan must be int32"):
        op(q, k, v, None, None, False, 0.25, 0, 0.0, None, None, None, index[:, :, :1], bits)
    with pytest.raises(RuntimeError, match="plan entry 1 is neither"):
        op(q, k, v, None, None, False, 0.25, 0, 0.0, None, None, None, index.fill_(1), bits)
    with pytest.raises(RuntimeError, match="plan_bits must be"):
        op(q, k, v, None, None, False, 0.25, 0, 0.0, None, None, None, index.fill_(-1),
           bits[:, :, :64])
    with pytest.raises(RuntimeError, match="does not apply the score variants"):
        torch.ops.mha._flash_attention_fwd_kernel(q, k, v, None, None, False, 0.25, "small", 0,
                                                  0.0, None, None, None, index, bits)


def test_plans_are_deterministic_across_thread_counts():
    q, k, v = _case(1, 4, 2, 300, 300, 32, torch.float32)
    mod = mods.or_masks(mods.document(cu_seqlens=[0, 70, 300]), mods.sliding_window(40))

    def run():
        ts = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = mha.attention(*ts, mask_mod=mod, softcap=5.0, backend="flash_cpu")
        out.square().sum().backward()
        return [out.detach()] + [t.grad for t in ts]

    one, two = with_threads(1, run), with_threads(2, run)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)
