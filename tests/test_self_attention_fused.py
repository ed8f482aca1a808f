"""The module's fused forward in bf16 and fp32 (``torch.ops.mha.self_attention_bf16`` /
``self_attention_f32``, ``mha.ops.self_attention``): QKV projection, attention and W_O in one
native call.

Shape legend: B batch, T sequence length, D model width, h heads, d head dim.

The oracle is the same function in float64 on the same bf16 / fp32 values; the yardstick is the
module run step by step in the same dtype (torch's GEMMs and attention): in bf16 both round the
projections' outputs to bf16, in fp32 both sum in fp32, so the fused call's error must stay
within a few times the step-by-step module's. Every test runs in both dtypes (the ``dtype``
fixture), skipped with the reason where the build lacks that dtype's tiles.
"""

from __future__ import annotations

import pytest
import torch

import mha
from mha.ops import linear_choice
from mha.ops import self_attention as fused
from mha.threads import num_threads

pytestmark = pytest.mark.usefixtures("native_linear")  # MHA_LINEAR=native: fused where it can


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
FLOOR = {"bf16": 2e-3, "fp32": 1e-6}  # error allowed beyond 3x the step-by-step module's,
                                      # relative to the output's largest magnitude


@pytest.fixture(params=list(DTYPES))
def dtype(request) -> str:
    missing = fused.tiles(DTYPES[request.param])
    if missing is not None:
        pytest.skip(f"no fused {request.param} forward here: {missing}")
    return request.param


def _op(dtype):
    return getattr(torch.ops.mha, "self_attention_bf16" if dtype == "bf16" else
                   "self_attention_f32")


def _pack(dtype):
    return getattr(torch.ops.mha, "pack_panels_bf16" if dtype == "bf16" else "pack_panels_f32")


def _module(D, h, dtype, bias=True, seed=0):
    torch.manual_seed(seed)
    m = mha.MultiHeadAttention(D, h, bias=bias).eval()
    with torch.no_grad():  # biases away from zero, so a missing bias shows
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return m.to(DTYPES[dtype])


def _close(got, want, dtype):
    tol = 1e-2 if dtype == "bf16" else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def _at_1_and_2_threads(fn) -> tuple:
    """``fn()`` without grad at 1 thread, then at 2."""
    outs = []
    for n in (1, 2):
        with num_threads(n), torch.no_grad():
            outs.append(fn())
    return tuple(outs)


def _forward(m, x, **kwargs):
    """The last line of ``m.explain``: fused or step by step, and why."""
    return m.explain(x, **kwargs).splitlines()[-1]


def _float64(m, x):
    """The module's function in float64 on the same weights and input."""
    m64 = mha.MultiHeadAttention(m.d_model, m.num_heads, bias=m.out_proj.bias is not None)
    m64.load_state_dict(m.state_dict())
    m64 = m64.double().eval()
    with torch.no_grad():
        return m64(x.double(), backend="math")


def _step_by_step(m, x, monkeypatch):
    with monkeypatch.context() as mp, torch.no_grad():
        mp.setattr(linear_choice, "forced", lambda: "torch")
        assert _forward(m, x).startswith("forward: step by step")
        return m(x)


@pytest.mark.parametrize("B,T,D,h,bias", [
    (32, 20, 512, 8, True),   # the seeds' size
    (3, 1, 64, 4, True),      # one token, d = 16
    (2, 7, 128, 2, False),    # odd T (a zero key pair), no biases
    (5, 17, 256, 2, True),    # T past one 16-lane vector, d = 128
    (1, 64, 96, 6, True),     # the longest T served, D not a multiple of 64 (partial panels)
    (7, 33, 64, 1, True),     # one head, groups of 2 batch rows (96 // 33) and a short last one
    (2, 20, 256, 1, True),    # d = 256: fp32 scores summed in blocks of 128
])
def test_matches_float64(B, T, D, h, bias, dtype, monkeypatch):
    m = _module(D, h, dtype, bias)
    g = torch.Generator().manual_seed(B * 1000 + T)
    x = torch.randn(B, T, D, generator=g).to(DTYPES[dtype])
    with torch.no_grad():
        assert _forward(m, x).startswith(f"forward: fused {dtype} forward")
        got = m(x)
    want = _float64(m, x)
    ref = _step_by_step(m, x, monkeypatch)
    assert got.shape == (B, T, D) and got.dtype == DTYPES[dtype]
    err = (got.double() - want).abs().max().item()
    ref_err = (ref.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= 3 * ref_err + FLOOR[dtype] * scale, \
        f"fused error {err:.3e}, step by step {ref_err:.3e}"


def test_op_equals_module_and_reads_weights_as_they_are(dtype):
    """The module calls the op; a weight changed in place is read by the next call (nothing
    derived from it is kept)."""
    m = _module(128, 4, dtype)
    x = torch.randn(4, 12, 128).to(DTYPES[dtype])
    args = (m.in_proj.weight, m.in_proj.bias, m.out_proj.weight, m.out_proj.bias)
    with torch.no_grad():
        y = m(x)
        assert torch.equal(y, _op(dtype)(x, *args, 4, 32 ** -0.5))
        m.out_proj.weight.data.mul_(2)
        m.out_proj.bias.data.mul_(2)
        y2 = m(x)
    _close(y2, 2 * y, dtype)


def test_deterministic_across_threads(dtype):
    m = _module(256, 4, dtype)
    x = torch.randn(9, 20, 256).to(DTYPES[dtype])
    assert torch.equal(*_at_1_and_2_threads(lambda: m(x)))


def test_nan_propagates_within_its_batch_row(dtype):
    """A NaN in one token of batch row 0 reaches every query of that row (every key is visible:
    its score is NaN), as SDPA; the other rows stay finite."""
    m = _module(64, 4, dtype)
    x = torch.randn(3, 10, 64).to(DTYPES[dtype])
    x[0, 3, 5] = float("nan")
    with torch.no_grad():
        y = m(x)
    assert torch.isnan(y[0]).all()
    assert torch.isfinite(y[1:]).all()


def test_no_state_carried_between_calls(dtype):
    """The buffers are not zero-filled: a call after one full of NaN (and of another shape)
    gives the bits a call gives on its own, at 1 and 2 threads (T = 20 and 13: Q^T columns
    past T read rows never written in the call)."""
    m = _module(128, 4, dtype)
    for n in (1, 2):
        for T in (20, 13):
            x = torch.randn(5, T, 128).to(DTYPES[dtype])
            with num_threads(n), torch.no_grad():
                alone = m(x)
                m(torch.full((7, 33, 128), float("nan")).to(DTYPES[dtype]))
                after = m(x)
            assert torch.isfinite(alone).all()
            assert torch.equal(after, alone)


def test_calls_it_does_not_serve_run_step_by_step(dtype):
    m = _module(128, 4, dtype)
    x = torch.randn(2, 10, 128).to(DTYPES[dtype])
    tril = torch.ones(10, 10, dtype=torch.bool).tril()  # causal as a tensor: a mask
    with torch.no_grad():
        assert _forward(m, x, mask=tril).startswith("forward: step by step: the fused forward "
                                                    "has no mask")
        assert "has no window" in _forward(m, x, causal=True, window=4)
        long = torch.randn(1, fused.MAX_T + 1, 128).to(DTYPES[dtype])
        assert "T <= 64" in _forward(m, long)
        torch.testing.assert_close(m(long).float(), _float64(m, long).float(), rtol=0.05,
                                   atol=0.05)
    assert "a gradient is needed" in _forward(m, x)
    m64 = _module(128, 4, dtype).double()
    with torch.no_grad():
        assert "bfloat16 or float32 inputs only" in _forward(m64, x.double())


def test_training_keeps_gradients(dtype):
    """With gradients the module runs step by step (autograd through the native projections)."""
    m = _module(64, 4, dtype)
    x = torch.randn(2, 5, 64).to(DTYPES[dtype]).requires_grad_()
    m(x).float().sum().backward()
    assert x.grad is not None and m.in_proj.weight.grad is not None
    assert torch.isfinite(x.grad).all()


def test_op_refuses_bad_arguments_by_name(dtype):
    op, t = _op(dtype), DTYPES[dtype]
    other = torch.float64
    w_qkv, w_o = torch.zeros(96, 32, dtype=t), torch.zeros(32, 32, dtype=t)
    x = torch.zeros(2, 5, 32, dtype=t)
    with pytest.raises(RuntimeError, match=f"x must be a {str(t).split('.')[1]}"):
        op(x.to(other), w_qkv, None, w_o, None, 2, 0.25)
    with pytest.raises(RuntimeError, match="1 <= T <= 64"):
        op(torch.zeros(1, 65, 32, dtype=t), w_qkv, None, w_o, None, 2, 0.25)
    with pytest.raises(RuntimeError, match="w_qkv must be"):
        op(x, w_qkv[:64], None, w_o, None, 2, 0.25)
    with pytest.raises(RuntimeError, match="b_o must have shape"):
        op(x, w_qkv, None, w_o, torch.zeros(31, dtype=t), 2, 0.25)


@pytest.mark.parametrize(("native_s", "fused_runs"), [(1.05, True), (1.5, False)])
def test_measured_gate(tmp_path, monkeypatch, native_s, fused_runs, dtype):
    """Fused only while the dtype's tiles measured within TILES_MARGIN of torch's GEMM of that
    dtype on the QKV class (injected measurement: bf16 tiles, or the fp32 projections' own
    measurement); the reason names the ratio."""
    monkeypatch.setattr(linear_choice, "path", lambda: tmp_path / linear_choice.FILE)
    monkeypatch.setattr(linear_choice, "forced", lambda: None)
    monkeypatch.setattr(linear_choice, "_memo", {})
    timer = "measure_bf16_tiles" if dtype == "bf16" else "measure"
    monkeypatch.setattr(linear_choice, timer, lambda shape: (native_s, 1.0))
    m = _module(128, 4, dtype)
    x = torch.randn(4, 20, 128).to(DTYPES[dtype])
    with torch.no_grad():
        line = _forward(m, x)
        y = m(x)
    assert line.startswith("forward: fused") == fused_runs, line
    if not fused_runs:
        assert f"1.50x slower than torch's {dtype} GEMM" in line
    torch.testing.assert_close(y.float(), _float64(m, x).float(), rtol=0.05, atol=0.05)


# ----------------------------------------------------------------------------- packed panels
@pytest.mark.parametrize("N,K", [(192, 64), (96, 128), (16, 32), (130, 48)])
def test_pack_panels_layout(N, K, dtype):
    """bf16: panels[p, k2, j, e] = W[64 p + j, 2 k2 + e]; fp32: panels[p, k, j] = W[64 p + j, k];
    zero past N (partial last panel)."""
    w = torch.randn(N, K).to(DTYPES[dtype])
    got = _pack(dtype)(w)
    P = (N + 63) // 64
    padded = torch.zeros(P * 64, K, dtype=w.dtype)
    padded[:N] = w
    if dtype == "bf16":
        want = padded.view(P, 64, K // 2, 2).transpose(1, 2)  # (P, 64, K2, 2) -> (P, K2, 64, 2)
    else:
        want = padded.view(P, 64, K).transpose(1, 2)  # (P, 64, K) -> (P, K, 64)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got, want)


@pytest.mark.parametrize("B,T,D,h", [(32, 20, 512, 8), (1, 64, 96, 6), (3, 7, 64, 4)])
def test_given_panels_give_the_same_bits(B, T, D, h, dtype):
    m = _module(D, h, dtype)
    x = torch.randn(B, T, D).to(DTYPES[dtype])
    op = _op(dtype)
    args = (m.in_proj.weight, m.in_proj.bias, m.out_proj.weight, m.out_proj.bias, h, 0.125)
    wq_p = _pack(dtype)(m.in_proj.weight)
    wo_p = _pack(dtype)(m.out_proj.weight)
    with torch.no_grad():
        packed_here = op(x, *args)
        for panels in ((wq_p, wo_p), (wq_p, None), (None, wo_p)):
            assert torch.equal(op(x, *args, *panels), packed_here)


def test_op_refuses_bad_panels_by_name(dtype):
    op, pack, t = _op(dtype), _pack(dtype), DTYPES[dtype]
    w_qkv, w_o = torch.zeros(96, 32, dtype=t), torch.zeros(32, 32, dtype=t)
    x = torch.zeros(2, 5, 32, dtype=t)
    good_q = pack(w_qkv)
    with pytest.raises(RuntimeError, match="w_qkv_panels must be contiguous with shape"):
        op(x, w_qkv, None, w_o, None, 2, 0.25, good_q[:1], None)
    with pytest.raises(RuntimeError, match="w_o_panels must be contiguous with shape"):
        op(x, w_qkv, None, w_o, None, 2, 0.25, None, good_q)
    with pytest.raises(RuntimeError, match=f"w_o_panels must be a {str(t).split('.')[1]}"):
        op(x, w_qkv, None, w_o, None, 2, 0.25, None, pack(w_o).double())
    if dtype == "bf16":
        with pytest.raises(RuntimeError, match="K even"):
            pack(torch.zeros(4, 5).bfloat16())


def test_freeze_keeps_the_bits_and_says_so(dtype):
    m = _module(128, 4, dtype)
    x = torch.randn(4, 12, 128).to(DTYPES[dtype])
    with torch.no_grad():
        y = m(x)
        assert m.freeze() is m and m.frozen.packs == 2
        assert torch.equal(m(x), y) and torch.equal(m(x), y)
    assert m.frozen.packs == 2  # packed once, not per call
    with torch.no_grad():
        assert "weights packed by freeze()" in _forward(m, x)
        assert "weights packed by freeze()" not in _forward(m.unfreeze(), x)


def test_freeze_refusals_leave_the_module_unchanged(dtype):
    mixed = _module(128, 4, dtype)
    mixed.out_proj.to(torch.float32 if dtype == "bf16" else torch.bfloat16)
    cases = [(_module(128, 4, dtype).double(), ValueError, "in_proj.weight is torch.float64"),
             (mixed, ValueError, "weights of one dtype"),
             (mha.MultiHeadAttention(128, 4, kdim=96, vdim=96).to(DTYPES[dtype]), ValueError,
              "kdim == vdim == d_model"),
             (mha.MultiHeadAttention(128, 8, num_kv_heads=2).to(DTYPES[dtype]), ValueError,
              "equal query and key/value heads")]
    for m, error, match in cases:
        state = {k: v.clone() for k, v in m.state_dict().items()}
        with pytest.raises(error, match=match):
            m.freeze()
        assert m.frozen is None
        assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items())


def test_frozen_module_serves_other_calls_with_current_weights():
    """Calls the fused forward does not serve (a mask) read the weights as they are, frozen or
    not; after ``.float()`` (new weight tensors of another dtype) the fused fp32 call packs them
    again, where the build has both dtypes' tiles."""
    for kind in DTYPES:
        if fused.tiles(DTYPES[kind]) is not None:
            pytest.skip(f"no fused {kind} forward here: {fused.tiles(DTYPES[kind])}")
    m = _module(64, 4, "bf16").freeze()
    x = torch.randn(2, 9, 64).bfloat16()
    with torch.no_grad():
        m(x)
        m.in_proj.weight.data.mul_(2)  # not seen by the fused call (documented), seen by these
        twin = _module(64, 4, "bf16")
        twin.load_state_dict(m.state_dict())
        tril = torch.ones(9, 9, dtype=torch.bool).tril()
        assert torch.equal(m(x, mask=tril), twin(x, mask=tril))
        m.float()
        assert torch.equal(m(x.float()), twin.float()(x.float()))


# ----------------------------------------------------------------------------- causal
CAUSAL_SHAPES = [  # (B, T, D, h): T across the 16-query vectors, the 6-query P V blocks and
    (3, 1, 64, 4),       # the pairs of keys (bf16); d = 16
    (2, 2, 64, 2),       # one pair of keys
    (4, 15, 128, 4),     # one vector short of full
    (1, 16, 128, 2),     # one full vector, d = 64
    (5, 17, 256, 2),     # one query into the second vector, d = 128
    (2, 63, 96, 6),      # odd T, D not a multiple of 64
    (1, 64, 512, 8),     # the longest T served
    (32, 20, 512, 8),    # the seeds' size
    (7, 33, 64, 1),      # one head, groups of 2 batch rows and a short last one
    (2, 40, 256, 1),     # d = 256: P V's columns in 4 blocks
]


@pytest.mark.parametrize("B,T,D,h", CAUSAL_SHAPES)
def test_causal_matches_step_by_step(B, T, D, h, dtype, monkeypatch):
    """Causal (query i sees keys j <= i) fused: within the step-by-step module's tolerance of
    it, and as near the float64 module as the step-by-step module is (3x + FLOOR)."""
    m = _module(D, h, dtype, bias=T % 2 == 0)
    g = torch.Generator().manual_seed(B * 1000 + T)
    x = torch.randn(B, T, D, generator=g).to(DTYPES[dtype])
    with torch.no_grad():
        line = _forward(m, x, causal=True)
        assert line.startswith(f"forward: fused {dtype} forward") and "causal" in line, line
        got = m(x, causal=True)
        m64 = mha.MultiHeadAttention(D, h, bias=m.out_proj.bias is not None)
        m64.load_state_dict(m.state_dict())
        want = m64.double().eval()(x.double(), causal=True, backend="math")
    with monkeypatch.context() as mp, torch.no_grad():
        mp.setattr(linear_choice, "forced", lambda: "torch")
        assert _forward(m, x, causal=True).startswith("forward: step by step")
        ref = m(x, causal=True)
    assert got.shape == (B, T, D) and got.dtype == DTYPES[dtype]
    _close(got, ref, dtype)
    err = (got.double() - want).abs().max().item()
    ref_err = (ref.double() - want).abs().max().item()
    assert err <= 3 * ref_err + FLOOR[dtype] * want.abs().max().item(), \
        f"fused error {err:.3e}, step by step {ref_err:.3e}"


@pytest.mark.parametrize("T,j", [(20, 0), (20, 1), (20, 12), (20, 19), (17, 16), (64, 15),
                                 (64, 16), (64, 33), (64, 63), (2, 1)])
@pytest.mark.parametrize("bad", ["nan", "inf", "huge"])
def test_causal_nonfinite_later_token_stays_out_of_earlier_rows(T, j, bad, dtype):
    """Token j of batch row 0 NaN, Inf or huge (its query, key and value all non-finite or
    huge): the rows i < j of that batch row give the bits they give with a finite token j
    (they never read it: not through a masked score, a product with its value, nor as the
    partner of a bf16 pair), rows i >= j are not finite as SDPA's, other batch rows keep
    their bits."""
    m = _module(64, 4, dtype)
    g = torch.Generator().manual_seed(T * 100 + j)
    x = torch.randn(3, T, 64, generator=g).to(DTYPES[dtype])
    poisoned = x.clone()
    poisoned[0, j] = {"nan": float("nan"), "inf": float("inf"), "huge": 3e37}[bad]
    with torch.no_grad():
        clean, y = m(x, causal=True), m(poisoned, causal=True)
    assert torch.equal(y[0, :j], clean[0, :j])
    assert torch.isfinite(clean).all()
    if bad != "huge":
        assert not torch.isfinite(y[0, j:]).any(dim=-1).any()
    assert torch.equal(y[1:], clean[1:])


@pytest.mark.parametrize("B,T,D,h", [(9, 20, 256, 4), (3, 64, 128, 2), (5, 17, 64, 4)])
def test_causal_deterministic_across_threads(B, T, D, h, dtype):
    m = _module(D, h, dtype)
    x = torch.randn(B, T, D).to(DTYPES[dtype])
    assert torch.equal(*_at_1_and_2_threads(lambda: m(x, causal=True)))


def test_causal_frozen_and_unfrozen_give_the_same_bits(dtype):
    m = _module(128, 4, dtype)
    x = torch.randn(6, 23, 128).to(DTYPES[dtype])
    with torch.no_grad():
        y = m(x, causal=True)
        m.freeze()
        assert "weights packed by freeze()" in _forward(m, x, causal=True)
        assert torch.equal(m(x, causal=True), y)
        assert m.frozen.packs == 2
        m.unfreeze()
        assert torch.equal(m(x, causal=True), y)
        assert not torch.equal(m(x), y)  # not causal: another function


def test_causal_no_state_carried_between_calls(dtype):
    """Causal reads no row of its buffers it did not write (the bf16 P pairs included): a call
    after one full of NaN gives its own bits, at 1 and 2 threads."""
    m = _module(128, 4, dtype)
    for n in (1, 2):
        for T in (20, 13, 64):
            x = torch.randn(5, T, 128).to(DTYPES[dtype])
            with num_threads(n), torch.no_grad():
                alone = m(x, causal=True)
                m(torch.full((7, 64, 128), float("nan")).to(DTYPES[dtype]))
                m(torch.full((7, 64, 128), float("nan")).to(DTYPES[dtype]), causal=True)
                after = m(x, causal=True)
            assert torch.isfinite(alone).all()
            assert torch.equal(after, alone)


def test_op_causal_flag_and_fake(dtype):
    """The op's schema takes ``causal`` (default False: the non-causal call's bits); its fake
    gives the output's shape (opcheck: schema, fake tensor, dispatch)."""
    op = _op(dtype)
    m = _module(64, 4, dtype)
    x = torch.randn(2, 9, 64).to(DTYPES[dtype])
    args = (x, m.in_proj.weight.detach(), m.in_proj.bias.detach(), m.out_proj.weight.detach(),
            m.out_proj.bias.detach(), 4, 0.25)
    assert torch.equal(op(*args), op(*args, None, None, False))
    causal = op(*args, None, None, True)
    torch.testing.assert_close(causal[:, -1].float(), op(*args)[:, -1].float(),  # sees all
                               rtol=1e-2 if dtype == "bf16" else 1e-5,
                               atol=1e-2 if dtype == "bf16" else 1e-5)
    assert not torch.allclose(causal[:, 0].float(), op(*args)[:, 0].float())
    torch.library.opcheck(op, (*args, None, None, True))


# ----------------------------------------------------------------------------- rope
@pytest.mark.parametrize("B,T,D,h,r,interleaved", [
    (32, 20, 512, 8, None, False),  # the seeds' size, the whole head turned (Llama)
    (3, 17, 128, 2, 24, False),     # partial rotary (NeoX), r / 2 = 12: a masked remainder
    (1, 64, 96, 6, 16, True),       # GPT-J pairs, the longest T
    (4, 7, 64, 4, 2, True),         # one pair
    (2, 33, 256, 1, 40, False),     # d = 256
])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("positions", [None, "per row"])
def test_rope_fused_matches_step_by_step(B, T, D, h, r, interleaved, causal, positions, dtype,
                                         monkeypatch):
    """The module's rope in the fused forward: Q and K turned after the projection (fp32,
    rounded once, as mha.rope), default positions or a (B, T) tensor; within the step-by-step
    module's tolerance and as near float64 as it is."""
    rot = mha.rope.Rotary(dim=r or D // h, interleaved=interleaved)
    torch.manual_seed(T)
    m = mha.MultiHeadAttention(D, h, rope=rot).eval()
    m = m.to(DTYPES[dtype])
    x = torch.randn(B, T, D).to(DTYPES[dtype])
    kw = dict(causal=causal)
    if positions:
        kw["positions"] = torch.randint(0, 300, (B, T))
    with torch.no_grad():
        line = _forward(m, x, causal=causal)
        assert line.startswith(f"forward: fused {dtype} forward") and "RoPE" in line, line
        got = m(x, **kw)
        m64 = mha.MultiHeadAttention(D, h, rope=rot)
        m64.load_state_dict(m.state_dict())
        want = m64.double().eval()(x.double(), backend="math", **kw)
    with monkeypatch.context() as mp, torch.no_grad():
        mp.setattr(linear_choice, "forced", lambda: "torch")
        ref = m(x, **kw)
    _close(got, ref, dtype)
    err = (got.double() - want).abs().max().item()
    ref_err = (ref.double() - want).abs().max().item()
    assert err <= 3 * ref_err + FLOOR[dtype] * want.abs().max().item(), \
        f"fused error {err:.3e}, step by step {ref_err:.3e}"


def test_rope_fused_deterministic_frozen_and_across_threads(dtype):
    m = mha.MultiHeadAttention(128, 4, rope=True).eval().to(DTYPES[dtype])
    x = torch.randn(9, 20, 128).to(DTYPES[dtype])
    one, two = _at_1_and_2_threads(lambda: m(x, causal=True))
    assert torch.equal(one, two)
    with torch.no_grad():
        assert torch.equal(m.freeze()(x, causal=True), one)


def test_op_refuses_bad_rope_tables_by_name(dtype):
    op, t = _op(dtype), DTYPES[dtype]
    w_qkv, w_o = torch.zeros(96, 32, dtype=t), torch.zeros(32, 32, dtype=t)
    x = torch.zeros(2, 5, 32, dtype=t)
    good = torch.zeros(1, 5, 16)
    args = (x, w_qkv, None, w_o, None, 2, 0.25, None, None, False)
    op(*args, good, good)  # (1, T, r), r = d
    op(*args, torch.zeros(2, 5, 4), torch.zeros(2, 5, 4), True)  # (B, T, r)
    with pytest.raises(RuntimeError, match="given together"):
        op(*args, good, None)
    for bad in (torch.zeros(1, 5, 18), torch.zeros(1, 5, 3), torch.zeros(3, 5, 16),
                torch.zeros(1, 4, 16), torch.zeros(1, 5, 16, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match=r"rope_cos and rope_sin must be .* \(B or 1, T, r\)"):
            op(*args, bad, bad)
