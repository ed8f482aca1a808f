"""The fused native backward of flash_cpu (``mha::flash_attention_bwd_fused``).

Shape legend: B batch, h query heads, h_kv key/value heads, Tq/Tk lengths, d_k/d_v head dims.
Accuracy rule (tests/oracle.py): each gradient's error vs the fp64 reference is at most twice
the error of the same gradient computed naively in the input dtype, plus a small floor.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from examples import examples
from kernel_inputs import bool_mask as _mask
from kernel_inputs import key_lengths, layout_tensor, qkv
from mha import reference
from mha.masks import MaskSpec
from mha.ops import flash

from oracle import FLOOR, max_err


@pytest.fixture(scope="module", autouse=True)
def built():
    assert flash.unavailable() is None, flash.unavailable()
    assert flash.load_backward() is None  # a build failure fails these tests


def _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, layout, seed):
    """q, k, v, grad_out, grad_lse; "bthd" views of (B, T, h, d) tensors, "strided" a last-dim
    stride of 2, else contiguous (B, h, T, d)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = qkv(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, layout, g=g)
    go = layout_tensor(B, h, Tq, d_v, dtype, layout, g)  # (B, h, Tq, d_v)
    return q, k, v, go, torch.randn(B, h, Tq, generator=g).to(dtype)


def _reference_grads(q, k, v, go, gl, spec, scale, upcast):
    """Gradients of sum(out * go) + sum(lse * gl) (rows that see a key; go / gl None: left
    out) by autograd through the per-head reference loop, in float64 (upcast) or the inputs'
    dtype; and the out."""
    B, h, Tq, _ = q.shape
    Tk = k.shape[2]
    dt = torch.float64 if upcast else q.dtype
    ins = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
    allowed = spec.materialize(B, h, Tq, Tk)
    out = reference.attention(*ins, allowed=allowed, scale=scale)[0]  # (B, h, Tq, d_v)
    kk = ins[1].repeat_interleave(h // k.shape[1], 1)  # (B, h, Tk, d_k)
    s = torch.einsum("bhqd,bhkd->bhqk", ins[0], kk) * scale  # (B, h, Tq, Tk)
    if allowed is not None:
        s = s.masked_fill(~spec.dense(B, h, Tq, Tk), float("-inf"))
    lse = s.logsumexp(-1)  # (B, h, Tq)
    fin = torch.isfinite(lse)
    loss = 0.0 * out.sum()
    if go is not None:
        loss = loss + (out * go.to(dt)).sum()
    if gl is not None:
        loss = loss + (lse[fin] * gl.to(dt)[fin]).sum()
    return torch.autograd.grad(loss, ins), out.detach()


def _cancellation(q, k, go, out, scale) -> float:
    """Size of the rounding FlashAttention's ``dS = P (dP - rowsum(dO O))`` cannot avoid: the
    two terms cancel (exactly, for a row that sees one key), so dq/dk inherit
    ``eps * sum|dO O| * scale * |k or q|`` however carefully they are summed."""
    terms = (go.double() * out.double()).abs().sum(-1).max().item()  # max_row sum |dO O|
    return terms * scale * max(q.abs().max().item(), k.abs().max().item(), 1.0)


def _assert_same_bits_across_threads(op, args):
    """op(*args) gives the same bits run with 2, 1 and 2 threads."""
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (2, 1, 2):
            torch.set_num_threads(n)
            runs.append(op(*args))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


def _native_grads(q, k, v, go, gl, spec, scale, *, use_go=True, use_gl=True):
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash.flash_attention(*ins, causal=spec.causal, key_lengths=spec.key_lengths,
                                      mask=spec.mask, scale=scale)
    loss = 0
    if use_go:
        loss = loss + (out * go).sum()
    if use_gl:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0) * gl.float()).sum()
    return torch.autograd.grad(loss, ins)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), h_kv=st.integers(1, 2), group=st.sampled_from([1, 2, 3]),
       Tq=st.integers(1, 150), Tk=st.integers(1, 150),
       d_k=st.sampled_from([16, 17, 33, 64, 80, 128, 256]), d_v=st.sampled_from([16, 24, 64, 100]),
       causal=st.booleans(), lengths=st.booleans(), mask=st.sampled_from([None, "full", "rows",
                                                                          "keys"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       layout=st.sampled_from(["bhtd", "bthd", "strided"]), seed=st.integers(0, 2**16))
# d_k = 256 fp32: S recomputed with the forward's sums (blocks of 128 products), one key block
# and several
@example(B=2, h_kv=1, group=1, Tq=55, Tk=33, d_k=256, d_v=100, causal=False, lengths=True,
         mask="keys", dtype=torch.float32, layout="bthd", seed=18)
@example(B=1, h_kv=2, group=2, Tq=150, Tk=150, d_k=256, d_v=64, causal=True, lengths=False,
         mask="rows", dtype=torch.float32, layout="bhtd", seed=3)
def test_gradients_vs_fp64_reference(B, h_kv, group, Tq, Tk, d_k, d_v, causal, lengths, mask,
                                     dtype, layout, seed):
    h = h_kv * group
    q, k, v, go, gl = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, layout, seed)
    kl = key_lengths(B, Tk, seed, lengths)
    spec = MaskSpec(causal, kl, _mask(mask, B, h, Tq, Tk, seed))
    got = _native_grads(q, k, v, go, gl, spec, 0.3)
    want, out = _reference_grads(q, k, v, go, gl, spec, 0.3, upcast=True)
    low, _ = _reference_grads(q, k, v, go, gl, spec, 0.3, upcast=False)
    size = max(1.0, _cancellation(q, k, go, out, 0.3))
    for name, a, w, lo in zip("qkv", got, want, low, strict=True):
        assert a.dtype == dtype and a.shape == w.shape
        assert torch.isfinite(a).all()
        budget = 2 * max_err(lo, w) + FLOOR[dtype] * max(size, w.abs().max().item())
        assert max_err(a, w) <= budget, f"d{name}: error {max_err(a, w):.3e} > {budget:.3e}"


BF16_MATHS = ["bf16", "fp32"] if "avx512bf16" in flash.isa().split(",") else ["fp32"]
# the AMX tile products where this build has them (natively, or software tiles under
# MHA_AMX_EMULATE=1; tests/test_flash_bwd_amx.py runs them on every AVX512_BF16 CPU)
BF16_MATHS += ["amx"] if any(i.startswith("amx") for i in flash.isa().split(",")) else []


@pytest.mark.parametrize("math", BF16_MATHS)
@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), h_kv=st.integers(1, 2), group=st.sampled_from([1, 3]),
       Tq=st.integers(1, 140), Tk=st.integers(1, 140), d_k=st.sampled_from([16, 17, 33, 64, 128]),
       d_v=st.sampled_from([15, 24, 64, 100]), causal=st.booleans(), lengths=st.booleans(),
       mask=st.sampled_from([None, "full", "keys"]), use_gl=st.booleans(),
       layout=st.sampled_from(["bhtd", "bthd", "strided"]), seed=st.integers(0, 2**16))
def test_bf16_products_vs_fp64_reference(math, B, h_kv, group, Tq, Tk, d_k, d_v, causal,
                                         lengths, mask, use_gl, layout, seed):
    """bf16 inputs through either arithmetic of the five products: vdpbf16ps (P and dS rounded
    to bf16, operands pair-packed: odd d, odd Tq and causal blocks that start on an odd row
    take padding) or fp32; both within the budget of the naive bf16 gradients."""
    h = h_kv * group
    q, k, v, go, gl = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, torch.bfloat16, layout, seed)
    kl = key_lengths(B, Tk, seed, lengths)
    spec = MaskSpec(causal, kl, _mask(mask, B, h, Tq, Tk, seed))
    if not use_gl:
        gl = torch.zeros_like(gl)
    out, lse = flash.flash_attention(q, k, v, causal=causal, key_lengths=kl, mask=spec.mask,
                                      scale=0.3)
    got = torch.ops.mha._flash_attention_bwd_fused_math(go, gl.float() if use_gl else None, q, k,
                                                        v, out, lse, kl, spec.mask, causal, 0.3,
                                                        math)
    want, ref_out = _reference_grads(q, k, v, go, gl, spec, 0.3, upcast=True)
    low, _ = _reference_grads(q, k, v, go, gl, spec, 0.3, upcast=False)
    size = max(1.0, _cancellation(q, k, go, ref_out, 0.3))
    for name, a, w, lo in zip("qkv", got, want, low, strict=True):
        assert a.dtype == torch.bfloat16 and a.shape == w.shape and torch.isfinite(a).all()
        budget = 2 * max_err(lo, w) + FLOOR[torch.bfloat16] * max(size, w.abs().max().item())
        assert max_err(a, w) <= budget, f"d{name}: error {max_err(a, w):.3e} > {budget:.3e}"


@pytest.mark.parametrize("math", BF16_MATHS)
def test_bf16_products_deterministic_across_thread_counts(math):
    q, k, v, go, gl = _inputs(1, 4, 1, 301, 700, 64, 64, torch.bfloat16, "bthd", 3)
    out, lse = flash.flash_attention(q, k, v, causal=True)
    _assert_same_bits_across_threads(torch.ops.mha._flash_attention_bwd_fused_math,
                                     (go, gl.float(), q, k, v, out, lse, None, None, True, 0.125,
                                      math))


@pytest.mark.parametrize("use_go,use_gl", [(True, False), (False, True), (True, True)])
def test_fused_matches_pytorch_backward(use_go, use_gl, monkeypatch):
    """Native vs the PyTorch fallback (in many chunks) on one awkward case: GQA, Tq > Tk causal
    (rows that see nothing), key_lengths with a 0, a broadcast mask, d_v != d_k, non-contiguous
    inputs."""
    monkeypatch.setattr(flash, "_CHUNK_ELEMENTS", 2000)  # ~5 query rows per chunk
    B, h, h_kv, Tq, Tk, d_k, d_v = 2, 6, 2, 97, 70, 40, 24
    q, k, v, go, gl = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, torch.float32, "bthd", 1)
    kl = torch.tensor([0, 51])
    m = _mask("rows", B, h, Tq, Tk, 2).reshape(1, 1, Tq, Tk)
    out, lse = flash.flash_attention(q, k, v, causal=True, key_lengths=kl, mask=m, scale=0.2)
    args = (go if use_go else None, gl.float() if use_gl else None, q, k, v, out, lse, kl, m,
            True, 0.2)
    fused = torch.ops.mha.flash_attention_bwd_fused(*args)
    ref = flash.flash_attention_bwd_torch(*args)
    for a, b in zip(fused, ref, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    assert fused[0][:, :, : Tq - Tk].abs().max() == 0  # causal rows that see no key
    assert fused[0][0].abs().max() == 0 and fused[1][0].abs().max() == 0  # key_lengths[0] = 0
    assert fused[1][1, :, 51:].abs().max() == 0 and fused[2][1, :, 51:].abs().max() == 0


def test_custom_op_falls_back_to_pytorch_when_the_extension_is_missing(monkeypatch):
    q, k, v, go, gl = _inputs(1, 4, 2, 30, 45, 16, 24, torch.float32, "bthd", 6)
    spec = MaskSpec(True, torch.tensor([40]), None)
    fused = _native_grads(q, k, v, go, gl, spec, 0.25)
    calls = []
    real = flash.flash_attention_bwd_torch

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(flash, "load_backward", lambda: "simulated: no compiler")
    monkeypatch.setattr(flash, "flash_attention_bwd_torch", spy)
    fallback = _native_grads(q, k, v, go, gl, spec, 0.25)
    assert calls
    for a, b in zip(fused, fallback, strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_no_gradients_give_zeros():
    q, k, v, go, gl = _inputs(1, 2, 1, 5, 7, 16, 16, torch.float32, "bhtd", 0)
    out, lse = flash.flash_attention(q, k, v)
    for t in torch.ops.mha.flash_attention_bwd_fused(None, None, q, k, v, out, lse, None, None,
                                                     False, 0.25)[:3]:
        assert t.abs().max() == 0


@pytest.mark.parametrize("shape", [(1, 8, 8, 200, 200, 64), (1, 4, 1, 300, 700, 32)])
def test_deterministic_across_thread_counts(shape):
    """Same bits for repeated runs and for 1 or 2 threads (the second shape splits key blocks
    over several units, whose partial dQ are summed in a fixed order)."""
    B, h, h_kv, Tq, Tk, d = shape
    q, k, v, go, gl = _inputs(B, h, h_kv, Tq, Tk, d, d, torch.float32, "bthd", 3)
    out, lse = flash.flash_attention(q, k, v, causal=True)
    _assert_same_bits_across_threads(torch.ops.mha.flash_attention_bwd_fused,
                                     (go, gl.float(), q, k, v, out, lse, None, None, True, 0.125))


def test_opcheck():
    q, k, v, go, gl = _inputs(2, 4, 2, 9, 13, 16, 24, torch.float32, "bthd", 4)
    kl = torch.tensor([13, 4])
    m = _mask("keys", 2, 4, 9, 13, 5)
    out, lse = flash.flash_attention(q, k, v, causal=True, key_lengths=kl, mask=m)
    args = (go, gl.float(), q, k, v, out, lse, kl, m, True, 0.25)
    torch.library.opcheck(torch.ops.mha.flash_attention_bwd_fused.default, args)
    torch.library.opcheck(torch.ops.mha.flash_attention_bwd.default, args)
    torch.library.opcheck(torch.ops.mha.flash_attention_bwd.default, (None,) + args[1:])


def test_rejects_bad_shapes_in_words():
    q, k, v, go, gl = _inputs(1, 2, 1, 5, 7, 16, 16, torch.float32, "bhtd", 0)
    out, lse = flash.flash_attention(q, k, v)
    with pytest.raises(RuntimeError, match="grad_out must have out's shape"):
        torch.ops.mha.flash_attention_bwd_fused(go[..., :8], None, q, k, v, out, lse, None, None,
                                                False, 0.25)
    with pytest.raises(RuntimeError, match=r"key_lengths must lie in \[0, Tk=7\]"):
        torch.ops.mha.flash_attention_bwd_fused(go, None, q, k, v, out, lse, torch.tensor([9]),
                                                None, False, 0.25)


def test_bench_train_rows_check_gradients():
    """The bench's training rows time fwd + bwd of mha and SDPA and check the gradients."""
    from mha.bench import attention, core

    ctx = core.Context(repeat=2, min_time=0.0, sample_time=0.001, settle=0.0,
                       measure_memory=False)
    case = attention.train_case(attention.Shape(2, 2, 40, 16, "fp32", True), ctx)
    rows = {r.impl: r for r in core.measure(case, ctx)}
    assert set(rows) == {"torch sdpa", "mha auto"}
    for r in rows.values():
        assert r.status == "ok", r.reason
        assert r.check.startswith("max |grad - SDPA fp32|")
    assert "flash_cpu" in rows["mha auto"].note


def test_double_backward_raises_one_clear_error():
    """create_graph=True works for one gradient; a gradient of it through flash_cpu raises
    a message that names the way out, not a torch internal one."""
    import mha

    q, k, v, _, _ = _inputs(1, 2, 1, 20, 20, 16, 16, torch.float32, "bhtd", 0)
    ins = [t.requires_grad_() for t in (q, k, v)]
    out = mha.attention(*ins, causal=True, backend="flash_cpu")
    dq, = torch.autograd.grad((out ** 2).sum(), ins[0], create_graph=True)
    assert torch.isfinite(dq).all()
    with pytest.raises(RuntimeError, match=r'double backward .* not supported by the native '
                                           r'kernel.*backend="math"'):
        torch.autograd.grad(dq.sum(), ins)
    out = mha.attention(*ins, causal=True, backend="math")  # the way out works
    dq, = torch.autograd.grad((out ** 2).sum(), ins[0], create_graph=True)
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(dq.sum(), ins))
