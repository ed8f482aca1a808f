"""Every way a user can change a weight is seen by the module's next call.

Shape legend: B batch, Tq/Tk lengths, d_model width, h/h_kv heads; weights in nn.Linear layout
``(out_features, in_features)``.

Each case builds a module, runs it once (so anything the projections might keep from the weights
would exist), changes one parameter by one route — in place with or without a version bump,
through ``.data``, numpy or the storage, by rebinding ``.data``, by ``load_state_dict``, an
optimizer step or a dtype round trip — and checks the next output against the float64 per-head
loop fed the weights as they are now. The module's projections must run on ``mha.linear``'s
native op for this to test anything: where the CPU lacks AVX-512 the op's portable loops (same
packing and blocking, scalar tiles) are used instead of the ``F.linear`` fallback; where it has
AVX-512, the packed module's fp32 inference calls (no_grad, eval) run the fused forward
(``mha.ops.self_attention``, which packs the weights per call) and are checked the same way.

The NaN cases check the projections only: ``mha.linear`` gives the NaN pattern of ``F.linear``
for a NaN in x, in W^Q, W^K, W^V, W^O or in a bias.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mha
from mha.ops import linear
from mha.ops import self_attention as fused

B, TQ, TK = 2, 48, 64


pytestmark = pytest.mark.usefixtures("native_linear")  # tests/conftest.py


# ----------------------------------------------------------------------------- the modules
def _packed():
    return mha.MultiHeadAttention(128, 4)  # in_proj [W^Q; W^K; W^V] (384, 128)


def _cross():
    return mha.MultiHeadAttention(128, 4, kdim=96, vdim=96)  # q_proj, k_proj, v_proj


def _gqa():
    return mha.MultiHeadAttention(128, 8, num_kv_heads=2)  # in_proj (128 + 32 + 32, 128)


KINDS = {"packed": _packed, "cross": _cross, "gqa": _gqa}


def _inputs(m, kind):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, TQ, 128, generator=g)
    kv = torch.randn(B, TK, 96, generator=g) if kind == "cross" else None
    return x, kv


def _call(m, x, kv):
    return m(x) if kv is None else m(x, kv, kv)


def _expected(m, x, kv):
    """Float64 attention on F.linear projections with the module's weights as they are now."""
    def proj(inp, w, b):
        return F.linear(inp.double(), w.double(), None if b is None else b.double())

    (wq, bq), (wk, bk), (wv, bv) = m.projection_weights()
    src = x if kv is None else kv
    h, h_kv, d_k = m.num_heads, m.num_kv_heads, m.head_dim
    q = proj(x, wq, bq).unflatten(-1, (h, d_k)).transpose(1, 2)  # (B, h, Tq, d_k)
    k = proj(src, wk, bk).unflatten(-1, (h_kv, d_k)).transpose(1, 2)  # (B, h_kv, Tk, d_k)
    v = proj(src, wv, bv).unflatten(-1, (h_kv, m.v_head_dim)).transpose(1, 2)  # (B, h_kv, Tk, d_v)
    k, v = k.repeat_interleave(h // h_kv, 1), v.repeat_interleave(h // h_kv, 1)  # (B, h, Tk, .)
    a = torch.softmax(q @ k.transpose(-1, -2) / d_k ** 0.5, dim=-1)  # (B, h, Tq, Tk)
    heads = (a @ v).transpose(1, 2).flatten(2)  # (B, h, Tq, d_v) -> (B, Tq, h*d_v)
    return proj(heads, m.out_proj.weight, m.out_proj.bias)  # (B, Tq, d_model)


def _projection(m):
    """The projection weight the routes below change: W^Q/W^K/W^V packed, or W^V alone."""
    return m.in_proj if m.packed else m.v_proj


def _new_values(p):
    return torch.randn(p.shape, generator=torch.Generator().manual_seed(7), dtype=p.dtype)


def _check_all_native(m, x, kv):
    """Every projection of this call takes the native op (else the test would prove nothing)."""
    concat = x.new_zeros(B, TQ, m.num_heads * m.v_head_dim)  # (B, Tq, h*d_v)
    if m.packed:
        calls = [(x, m.in_proj.weight)]
    else:
        calls = [(x, m.q_proj.weight), (kv, m.k_proj.weight), (kv, m.v_proj.weight)]
    for inp, w in calls + [(concat, m.out_proj.weight)]:
        assert linear.why_not_native(inp, w, None) is None, linear.why_not_native(inp, w, None)


# ----------------------------------------------------------------------------- the routes
def _data_mul(m):
    _projection(m).weight.data.mul_(2)


def _data_copy(m):  # an EMA swap: p.data.copy_(ema)
    w = _projection(m).weight
    w.data.copy_(_new_values(w))


def _data_normal(m):  # Hugging Face's _init_weights
    _projection(m).weight.data.normal_()


def _numpy_write(m):
    _projection(m).weight.detach().numpy()[:] *= 2


def _data_rebind(m):
    w = _projection(m).weight
    w.data = _new_values(w)


def _data_clone_then_write(m):
    w = _projection(m).weight
    w.data = w.data.clone()
    w.data.mul_(-1)


def _storage_write(m):
    w = _projection(m).weight
    w.untyped_storage().copy_(_new_values(w).untyped_storage())


def _load_state_dict(m):
    sd = {k: v * 2 for k, v in m.state_dict().items()}
    m.load_state_dict(sd)


def _optimizer_step(m):
    opt = torch.optim.SGD(m.parameters(), lr=10.0)
    with torch.enable_grad():
        x = torch.randn(B, TQ, 128)
        kv = None if m.packed else torch.randn(B, TK, m.kdim)
        _call(m, x, kv).square().mean().backward()
    opt.step()


def _no_grad_mul(m):
    with torch.no_grad():
        _projection(m).weight.mul_(2)


def _no_grad_copy(m):
    w = _projection(m).weight
    with torch.no_grad():
        w.copy_(_new_values(w))


def _init_normal(m):
    torch.nn.init.normal_(_projection(m).weight)


def _dtype_round_trip(m):  # to float64, changed there, back to float32
    m.double()
    with torch.no_grad():
        _projection(m).weight.mul_(2)
    m.float()


def _bias_only(m):
    _projection(m).bias.data.add_(1)


def _out_proj_only(m):
    m.out_proj.weight.data.mul_(2)


ROUTES = {f.__name__.lstrip("_"): f for f in (
    _data_mul, _data_copy, _data_normal, _numpy_write, _data_rebind, _data_clone_then_write,
    _storage_write, _load_state_dict, _optimizer_step, _no_grad_mul, _no_grad_copy,
    _init_normal, _dtype_round_trip, _bias_only, _out_proj_only)}


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("route", list(ROUTES))
def test_changed_weight_is_seen(route, kind, grad, train):
    torch.manual_seed(0)
    m = KINDS[kind]().train(train)
    x, kv = _inputs(m, kind)
    _check_all_native(m, x, kv)
    with torch.set_grad_enabled(grad):
        before = _call(m, x, kv)
        ROUTES[route](m)
        after = _call(m, x, kv)
    want = _expected(m, x, kv)
    assert (before.double() - want).abs().max().item() > 1e-2, "the route changed nothing"
    err = (after.double() - want).abs().max().item()
    assert err < 1e-4 * max(1.0, want.abs().max().item()), \
        f"{route}: output differs from the current weights' by {err:.3e}"
    assert (after.grad_fn is not None) == grad


# ----------------------------------------------------------------------------- NaN patterns
def _same_nan_pattern(got, want):
    assert torch.equal(torch.isnan(got), torch.isnan(want)), \
        f"NaN at {torch.isnan(got).sum().item()} places, F.linear at {torch.isnan(want).sum().item()}"
    finite = ~torch.isnan(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("where", ["W^Q", "W^K", "W^V", "W^O", "b^Q", "b^O", "x"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_nan_pattern_matches_f_linear(where, kind):
    torch.manual_seed(0)
    m = KINDS[kind]()
    x, kv = _inputs(m, kind)
    (wq, bq), (wk, bk), (wv, bv) = m.projection_weights()
    target = {"W^Q": wq, "W^K": wk, "W^V": wv, "W^O": m.out_proj.weight, "b^Q": bq,
              "b^O": m.out_proj.bias}.get(where)
    with torch.no_grad():
        if target is None:
            x[1, 5, 17] = float("nan")
        else:
            target.view(-1)[target.numel() // 3] = float("nan")
        kv_in = x if kv is None else kv
        concat = torch.randn(B, TQ, m.num_heads * m.v_head_dim)
        calls = [(x, wq, bq), (kv_in, wk, bk), (kv_in, wv, bv),
                 (concat, m.out_proj.weight, m.out_proj.bias)]
        for inp, w, b in calls:
            rows = -(-linear.SMALL // (inp[0].numel() * w.shape[0]))  # enough for the native op
            inp = inp.repeat(rows, 1, 1)  # (B, T, K) -> (rows B, T, K)
            assert linear.why_not_native(inp, w, b) is None
            _same_nan_pattern(linear.linear(inp, w, b), F.linear(inp, w, b))
        got = m.project(x, kv_in, kv_in, kv is None)
        want = [F.linear(inp, w, b) for inp, w, b in calls[:3]]
        for g, w in zip(got, want, strict=True):
            _same_nan_pattern(g, w)
    assert any(torch.isnan(F.linear(*c)).any() for c in calls), "no NaN reached any projection"


def test_inf_and_nan_in_x_and_weight_together():
    """Inf times 0 is NaN and Inf - Inf is NaN: the same places as F.linear."""
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(96, 128, generator=g), torch.randn(192, 128, generator=g), \
        torch.randn(192, generator=g)
    x[3, 7], x[10, 0], w[20, 7], w[5, :] = float("inf"), float("nan"), 0.0, 0.0
    w[40, 9], w[41, 9] = float("inf"), float("-inf")
    b[77] = float("nan")
    with torch.no_grad():
        assert linear.why_not_native(x, w, b) is None
        _same_nan_pattern(linear.linear(x, w, b), F.linear(x, w, b))


# ----------------------------------------------------------------------------- frozen modules
# freeze() keeps the fused forward's packed weights (bf16 or fp32) between calls (opt-in): a
# weight moved in a way its version counter or storage pointer shows is packed again; writes that
# bypass both (through .data, numpy, the storage) are not seen until freeze() again. The routes
# below are the ones above; which side each is on is the documented contract.
FROZEN_SEEN = ("data_rebind", "data_clone_then_write", "load_state_dict", "no_grad_mul",
               "no_grad_copy", "init_normal", "dtype_round_trip", "bias_only")
FROZEN_UNSEEN = ("data_mul", "data_copy", "data_normal", "numpy_write", "storage_write",
                 "out_proj_only")


def _numpy_bits_write(m):  # numpy has no bfloat16: the bits, through an int16 view
    w = _projection(m).weight
    w.detach().view(torch.int16).numpy()[:] = _new_values(w).view(torch.int16).numpy()


FROZEN_ROUTES = dict(ROUTES, numpy_write=_numpy_bits_write)


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # the fused forward's dtypes


def _frozen_pair(dtype):
    """A frozen module of ``dtype`` and its unfrozen twin (same weights)."""
    missing = fused.tiles(DTYPES[dtype])
    if missing is not None:
        pytest.skip(f"freeze() cannot serve {dtype} here: {missing}")
    torch.manual_seed(0)
    m = _packed().to(DTYPES[dtype]).eval()
    twin = _packed().to(DTYPES[dtype]).eval()
    twin.load_state_dict(m.state_dict())
    return m.freeze(), twin


def _current(m, x):
    """What an unfrozen module with m's weights as they are now gives."""
    fresh = _packed().to(m.in_proj.weight.dtype).eval()
    fresh.load_state_dict(m.state_dict())
    with torch.no_grad():
        return fresh(x)


def test_frozen_routes_are_each_named():
    assert sorted(FROZEN_SEEN + FROZEN_UNSEEN) == sorted(set(ROUTES) - {"optimizer_step"})


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("route", FROZEN_SEEN)
def test_frozen_module_sees_versioned_changes(route, dtype):
    m, _ = _frozen_pair(dtype)
    x = _inputs(m, "packed")[0].to(DTYPES[dtype])
    with torch.no_grad():
        assert m.explain(x).splitlines()[-1].startswith("forward: fused")
        before = m(x)
        FROZEN_ROUTES[route](m)
        after = m(x.to(m.in_proj.weight.dtype))
    want = _current(m, x.to(m.in_proj.weight.dtype))
    assert not torch.equal(before.float(), want.float()), "the route changed nothing"
    assert torch.equal(after, want), f"{route}: the frozen module kept a stale weight"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("route", FROZEN_UNSEEN)
def test_frozen_module_misses_unversioned_writes_until_freeze(route, dtype):
    """The documented price of freeze(): these writes keep the old panels; freeze() again (or
    unfreeze()) reads the weights as they are."""
    m, twin = _frozen_pair(dtype)
    x = _inputs(m, "packed")[0].to(DTYPES[dtype])
    with torch.no_grad():
        assert m.explain(x).splitlines()[-1].startswith("forward: fused")
        m(x)
        FROZEN_ROUTES[route](m)
        stale = m(x)
        want = _current(m, x)
        assert not torch.equal(stale, want), "the route changed nothing"
        assert torch.equal(stale, twin(x))  # the weights as they were when packed
        assert torch.equal(m.freeze()(x), want)
        FROZEN_ROUTES[route](m)
        assert torch.equal(m.unfreeze()(x), _current(m, x))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_frozen_module_optimizer_step_is_seen(dtype):
    """Training a frozen module: the forward under autograd runs step by step on the weights as
    they are, and the optimizer's in-place step bumps the versions, so the next fused inference
    call packs again."""
    m, _ = _frozen_pair(dtype)
    x = _inputs(m, "packed")[0].to(DTYPES[dtype])
    with torch.no_grad():
        m(x)
    packs = m.frozen.packs
    opt = torch.optim.SGD(m.parameters(), lr=10.0)
    m(x).float().square().mean().backward()
    opt.step()
    with torch.no_grad():
        after = m(x)
    assert m.frozen.packs == packs + 2
    assert torch.equal(after, _current(m, x))
