"""Hostile inputs: every refusal is a clear error naming the argument, raised before any state
(module weights, cache storage and lengths, files) changes; and the inputs that are only
unusual (numpy scalars and arrays of the right kind, d_v = 0) give the ordinary answer.

Shape legend: B batch, h / h_kv heads, Tq / Tk lengths, d_k / d_v head dims, d_model width.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mha
from mha.backends import ORDER

B, H, H_KV, TQ, TK, D = 2, 4, 2, 3, 5, 8


def _qkv(d_k=D, d_v=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, TQ, d_k, generator=g)  # (B, h, Tq, d_k)
    k = torch.randn(B, H_KV, TK, d_k, generator=g)  # (B, h_kv, Tk, d_k)
    v = torch.randn(B, H_KV, TK, d_v, generator=g)  # (B, h_kv, Tk, d_v)
    return q, k, v


def _snapshot(*tensors):
    return [t.detach().clone() for t in tensors]


def _same(before, tensors):
    return all(torch.equal(a, b) for a, b in zip(before, tensors, strict=True))


# ----------------------------------------------------------------------------- mha.attention

ATTENTION_REFUSALS = [
    # (id, q/k/v head dims, kwargs, exception, pattern)
    ("d_k=0", (0, D), {}, ValueError, r"d_k >= 1"),
    ("d_k=0 d_v=0", (0, 0), {}, ValueError, r"d_k >= 1"),
    ("d_k=0 explicit scale", (0, D), {"scale": 1.0}, ValueError, r"d_k >= 1"),
    ("d_k=0 causal", (0, D), {"causal": True}, ValueError, r"d_k >= 1"),
    ("key_lengths complex", (D, D), {"key_lengths": torch.tensor([1 + 0j, 2])}, TypeError,
     r"key_lengths must be an integer tensor .*complex"),
    ("key_lengths bool", (D, D), {"key_lengths": torch.tensor([True, False])}, TypeError,
     r"key_lengths must be an integer tensor .*bool"),
    ("key_lengths numpy float", (D, D), {"key_lengths": np.array([1.0, 2.0])}, TypeError,
     r"key_lengths must be an integer tensor .*float64"),
    ("key_lengths numpy complex", (D, D), {"key_lengths": np.array([1j, 2])}, TypeError,
     r"key_lengths must be an integer tensor"),
    ("key_lengths strings", (D, D), {"key_lengths": ["1", "2"]}, TypeError,
     r"key_lengths must be an integer tensor"),
    ("key_lengths ragged list", (D, D), {"key_lengths": [1, [2]]}, TypeError,
     r"key_lengths must be an integer tensor"),
    ("key_lengths nested", (D, D), {"key_lengths": [[1, 2]]}, ValueError,
     r"key_lengths must have shape \(B,\) = \(2,\), got \(1, 2\)"),
    ("key_lengths 0-d", (D, D), {"key_lengths": torch.tensor(3)}, ValueError,
     r"key_lengths must have shape \(B,\)"),
    ("key_lengths negative", (D, D), {"key_lengths": [-1, 2]}, ValueError,
     r"key_lengths must lie in \[0, Tk=5\]"),
    ("scale inf", (D, D), {"scale": float("inf")}, ValueError, r"scale must lie in .*got inf"),
    ("scale nan", (D, D), {"scale": float("nan")}, ValueError, r"scale must lie in .*got nan"),
    ("scale numpy inf", (D, D), {"scale": np.float32("inf")}, ValueError, r"scale must lie in"),
    ("scale negative", (D, D), {"scale": -0.5}, ValueError, r"scale must lie in \[0.0, inf\)"),
    ("scale tensor", (D, D), {"scale": torch.tensor(0.5)}, TypeError,
     r"scale must be a number, got a 0-d torch.float32 tensor"),
    ("scale complex", (D, D), {"scale": 0.5 + 0j}, TypeError, r"scale must be a number, got complex"),
    ("scale numpy complex", (D, D), {"scale": np.complex64(0.5)}, TypeError,
     r"scale must be a number, got complex64"),
    ("scale bool", (D, D), {"scale": True}, TypeError, r"scale must be a number, got bool"),
    ("scale numpy bool", (D, D), {"scale": np.bool_(True)}, TypeError, r"scale must be a number"),
    ("dropout_p negative", (D, D), {"dropout_p": -0.1}, ValueError, r"dropout_p must lie in"),
    ("dropout_p numpy nan", (D, D), {"dropout_p": np.float64("nan")}, ValueError,
     r"dropout_p must lie in"),
    ("dropout_p string", (D, D), {"dropout_p": "0.1"}, TypeError, r"dropout_p must be a number, got str"),
    ("causal int", (D, D), {"causal": 1}, TypeError, r"causal must be a bool \(True or False\), got int"),
    ("causal numpy int", (D, D), {"causal": np.int64(1)}, TypeError, r"causal must be a bool.*got int64"),
    ("causal string", (D, D), {"causal": "yes"}, TypeError, r"causal must be a bool.*got str"),
    ("causal tensor", (D, D), {"causal": torch.tensor(True)}, TypeError,
     r"causal must be a bool.*0-d torch.bool tensor"),
    ("return_weights string", (D, D), {"return_weights": "no"}, TypeError,
     r"return_weights must be a bool.*got str"),
    ("window 0", (D, D), {"causal": True, "window": 0}, ValueError, r"window must be >= 1"),
    ("window negative numpy", (D, D), {"causal": True, "window": np.int32(-2)}, ValueError,
     r"window must be >= 1"),
    ("window numpy float", (D, D), {"causal": True, "window": np.float64(2.0)}, TypeError,
     r"window must be a positive int .*got float64"),
    ("window bool", (D, D), {"causal": True, "window": True}, TypeError,
     r"window must be a positive int .*got bool"),
    ("mask extra dims", (D, D), {"mask": torch.ones(1, 1, 1, TQ, TK, dtype=torch.bool)},
     ValueError, r"mask must be broadcastable to \(B, h, Tq, Tk\)"),
    ("mask float", (D, D), {"mask": torch.ones(TQ, TK)}, TypeError, r"mask must be a bool tensor"),
]


@pytest.mark.parametrize("dims, kwargs, exc, pattern",
                         [c[1:] for c in ATTENTION_REFUSALS], ids=[c[0] for c in ATTENTION_REFUSALS])
def test_attention_refusals_name_the_argument(dims, kwargs, exc, pattern):
    q, k, v = _qkv(*dims)
    before = _snapshot(q, k, v)
    with pytest.raises(exc, match=pattern):
        mha.attention(q, k, v, **kwargs)
    with pytest.raises(exc, match=pattern):
        mha.explain(q, k, v, **kwargs)
    assert _same(before, (q, k, v))


@pytest.mark.parametrize("backend", ORDER)
def test_d_k_zero_is_refused_by_every_backend(backend):
    q, k, v = _qkv(0, D)
    with pytest.raises(ValueError, match=r"q and k must have d_k >= 1"):
        mha.attention(q, k, v, backend=backend)


META_VALUES = [
    # (id, call on meta tensors): arguments whose values are checked name themselves
    ("key_lengths", lambda q, k, v: mha.attention(q, k, v, key_lengths=torch.tensor([1, 2], device="meta"))),
    ("key_lengths explain", lambda q, k, v: mha.explain(q, k, v, key_lengths=torch.tensor([1, 2], device="meta"))),
    ("alibi_slopes", lambda q, k, v: mha.attention(q, k, v, alibi_slopes=torch.ones(H, device="meta"))),
    ("cu_seqlens_q", lambda q, k, v: mha.varlen_attention(
        q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
        torch.tensor([0, TQ], device="meta"), torch.tensor([0, TK], device="meta"))),
]


@pytest.mark.parametrize("call", [c[1] for c in META_VALUES], ids=[c[0] for c in META_VALUES])
def test_meta_tensors_are_refused_by_name_or_by_device(call):
    q, k, v = (t.to("meta") for t in _qkv())
    name = [c[0] for c in META_VALUES if c[1] is call][0].split()[0]
    with pytest.raises(ValueError, match=f"^{name} is a meta tensor"):
        call(q, k, v)
    with pytest.raises(mha.BackendError, match="device meta not supported"):
        mha.attention(q, k, v, causal=True)  # no value to check: every backend says why not


@pytest.mark.parametrize("bad", [torch.zeros(B, H, TQ, D, dtype=torch.bool), torch.tensor(1.0),
                                 torch.zeros(B, H, TQ, D, dtype=torch.complex64)],
                         ids=["bool q", "0-d q", "complex q"])
def test_bad_q_is_named(bad):
    _, k, v = _qkv()
    with pytest.raises((TypeError, ValueError), match=r"^q must"):
        mha.attention(bad, k, v)


@pytest.mark.parametrize("backend", [None, *ORDER])
@pytest.mark.parametrize("causal", [False, True])
def test_d_v_zero_is_an_empty_output_on_every_backend(backend, causal):
    q, k, v = _qkv(D, 0)
    q.requires_grad_()
    out = mha.attention(q, k, v, causal=causal, backend=backend)
    assert out.shape == (B, H, TQ, 0)
    out.sum().backward()  # attached to the graph, zero gradient
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_d_v_zero_still_returns_the_softmax_weights():
    q, k, v = _qkv(D, 0)
    out, w = mha.attention(q, k, v, causal=True, return_weights=True)
    _, w1 = mha.attention(q, k, torch.ones(B, H_KV, TK, 1), causal=True, return_weights=True)
    assert out.shape == (B, H, TQ, 0)
    assert torch.equal(w, w1)


@pytest.mark.parametrize("backend", [None, "reference", "math", "sdpa"])
@pytest.mark.parametrize("window", [TK + 1, 2**63, 10**30])
def test_a_window_past_every_key_is_plain_causal(backend, window):
    q, k, v = _qkv()
    got = mha.attention(q, k, v, causal=True, window=window, backend=backend)
    assert torch.equal(got, mha.attention(q, k, v, causal=True, window=TK, backend=backend))
    torch.testing.assert_close(got, mha.attention(q, k, v, causal=True, backend=backend))


def _rows_overlapping(shape, dtype, seed):
    """A view whose consecutive rows share all but one element (row stride 1, like
    ``as_strided((B, h, T, d), (0, 0, 1, 1))``): unusual, legal, and read through its strides."""
    base = torch.randn(shape[-2] + shape[-1], generator=torch.Generator().manual_seed(seed))
    return base.to(dtype).as_strided(shape, (0, 0, 1, 1))


@pytest.mark.parametrize("backend", [None, *ORDER])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_views_with_overlapping_rows_give_the_contiguous_answer(backend, dtype, which):
    q, k, v = (t.to(dtype) for t in _qkv())
    shapes = {"q": q.shape, "k": k.shape, "v": v.shape}
    tensors = {"q": q, "k": k, "v": v}
    tensors[which] = _rows_overlapping(shapes[which], dtype, seed=1)
    try:
        got = mha.attention(*tensors.values(), causal=True, backend=backend)
    except mha.BackendError:
        assert backend is not None, "the default dispatch found no backend"
        return  # a backend that does not serve this dtype says so
    want = mha.attention(*(t.contiguous() for t in tensors.values()), causal=True,
                         backend=backend)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", [None, *ORDER])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("masks", ["none", "causal", "vmapped mask"])
def test_vmap_gives_the_per_slice_answer(backend, dtype, masks):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(3, *t.shape, generator=g, dtype=dtype) for t in _qkv())  # (3, B, ...)
    k[0, 0, 0, 1] = float("nan")  # a masked-off key in slice 0 (with the mask below)
    mask = torch.ones(3, TQ, TK, dtype=torch.bool)  # (3, Tq, Tk)
    mask[:, :, 1] = False
    kw = {"causal": masks == "causal"}

    def one(q, k, v, m):
        return mha.attention(q, k, v, backend=backend, mask=m if masks == "vmapped mask" else None,
                             **kw)

    try:
        got = torch.vmap(one)(q, k, v, mask)
    except mha.BackendError:
        assert backend is not None, "the default dispatch found no backend"
        return
    for i in range(3):
        want = mha.attention(q[i], k[i], v[i], backend="reference",
                             mask=mask[i] if masks == "vmapped mask" else None, **kw)
        torch.testing.assert_close(got[i], want, equal_nan=True)


def test_vmapped_key_lengths_are_refused_by_name():
    q, k, v = (torch.stack([t, t]) for t in _qkv())  # (2, B, ...)
    lengths = torch.tensor([[1, 5], [2, 3]])  # (2, B)
    with pytest.raises(ValueError, match=r"^key_lengths is batched by torch.vmap"):
        torch.vmap(lambda q, k, v, n: mha.attention(q, k, v, key_lengths=n))(q, k, v, lengths)
    unbatched = torch.vmap(lambda q, k, v: mha.attention(q, k, v, key_lengths=lengths[0]))(q, k, v)
    torch.testing.assert_close(unbatched[1], mha.attention(q[1], k[1], v[1], key_lengths=lengths[0]))


ATTENTION_ACCEPTED = [
    # (id, unusual kwargs, the plain-Python equivalent)
    ("causal numpy bool", {"causal": np.bool_(True)}, {"causal": True}),
    ("scale numpy float32", {"scale": np.float32(0.25)}, {"scale": 0.25}),
    ("scale numpy int", {"scale": np.int64(1)}, {"scale": 1.0}),
    ("dropout_p numpy float", {"dropout_p": np.float64(0.0)}, {"dropout_p": 0.0}),
    ("return_weights numpy bool", {"return_weights": np.bool_(False)}, {"return_weights": False}),
    ("window numpy int", {"causal": True, "window": np.int64(2)}, {"causal": True, "window": 2}),
    ("key_lengths numpy int", {"key_lengths": np.array([2, 5])}, {"key_lengths": torch.tensor([2, 5])}),
    ("key_lengths numpy int32", {"key_lengths": np.array([2, 5], dtype=np.int32)},
     {"key_lengths": torch.tensor([2, 5])}),
    ("key_lengths list", {"key_lengths": [2, 5]}, {"key_lengths": torch.tensor([2, 5])}),
]


@pytest.mark.parametrize("unusual, plain", [c[1:] for c in ATTENTION_ACCEPTED],
                         ids=[c[0] for c in ATTENTION_ACCEPTED])
def test_numpy_scalars_of_the_right_kind_are_accepted(unusual, plain):
    q, k, v = _qkv()
    assert torch.equal(mha.attention(q, k, v, **unusual), mha.attention(q, k, v, **plain))


# ----------------------------------------------------------------------------- varlen

def _packed(n=6):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, H, D, generator=g), torch.randn(n, H_KV, D, generator=g),
            torch.randn(n, H_KV, D, generator=g))  # (N, h, d_k), (N, h_kv, d_k), (N, h_kv, d_v)


CU_REFUSALS = [
    ("complex", torch.tensor([0, 4 + 0j, 6]), TypeError, r"cu_seqlens_q must be an integer tensor .*complex"),
    ("bool", torch.tensor([False, True]), TypeError, r"cu_seqlens_q must be an integer tensor .*bool"),
    ("float", torch.tensor([0.0, 4.0, 6.0]), TypeError, r"cu_seqlens_q must be an integer tensor .*float"),
    ("numpy float", np.array([0.0, 4.0, 6.0]), TypeError, r"cu_seqlens_q must be an integer tensor"),
    ("list with a float", [0, 4.0, 6], TypeError, r"cu_seqlens_q must be an integer tensor"),
    ("strings", ["0", "6"], TypeError, r"cu_seqlens_q must be an integer tensor"),
    ("nested", [[0, 4, 6]], ValueError, r"cu_seqlens_q must have shape \(S \+ 1,\)"),
    ("empty", torch.zeros(0, dtype=torch.int64), ValueError, r"cu_seqlens_q must have shape"),
    ("not sorted", [0, 4, 2, 6], ValueError, r"cu_seqlens_q must start at 0, never decrease"),
    ("wrong total", [0, 4, 5], ValueError, r"end at the token count 6"),
    ("not from 0", [1, 4, 6], ValueError, r"cu_seqlens_q must start at 0"),
]


@pytest.mark.parametrize("cu, exc, pattern", [c[1:] for c in CU_REFUSALS],
                         ids=[c[0] for c in CU_REFUSALS])
def test_cu_seqlens_refusals(cu, exc, pattern):
    q, k, v = _packed()
    with pytest.raises(exc, match=pattern):
        mha.varlen_attention(q, k, v, cu)


@pytest.mark.parametrize("cu", [np.array([0, 4, 6]), np.array([0, 4, 6], dtype=np.int32), [0, 4, 6],
                                (0, 4, 6), torch.tensor([0, 4, 6], dtype=torch.int32)],
                         ids=["numpy int64", "numpy int32", "list", "tuple", "int32 tensor"])
def test_cu_seqlens_integer_forms_work(cu):
    q, k, v = _packed()
    want = mha.varlen_attention(q, k, v, torch.tensor([0, 4, 6]), causal=True)
    assert torch.equal(mha.varlen_attention(q, k, v, cu, causal=np.bool_(True)), want)


def _p(n, h=H, d=D, dtype=torch.float32):
    return torch.randn(n, h, d, dtype=dtype)  # (N, heads, d)


PACKED_REFUSALS = [
    # (id, (q, k, v), cu_seqlens_q, kwargs, exception, pattern) — several with no sequence at
    # all (S = 0), where nothing is attended and the checks used to be skipped
    ("S=0 dtypes differ", lambda: (_p(0), _p(0, H_KV, dtype=torch.float64), _p(0, H_KV)), [0], {},
     TypeError, r"q, k, v must share one dtype"),
    ("S=0 causal string", lambda: (_p(0), _p(0, H_KV), _p(0, H_KV)), [0], {"causal": "yes"},
     TypeError, r"^causal must be a bool"),
    ("S=0 scale nan", lambda: (_p(0), _p(0, H_KV), _p(0, H_KV)), [0], {"scale": float("nan")},
     ValueError, r"^scale must lie in"),
    ("S=0 d_k mismatch", lambda: (_p(0), _p(0, H_KV, 4), _p(0, H_KV)), [0], {},
     ValueError, r"must share d_k >= 1"),
    ("v shorter than k", lambda: (_p(6), _p(6, H_KV), _p(5, H_KV)), [0, 3, 6], {},
     ValueError, r"k \(N_k, h_kv, d_k\) and v \(N_k, h_kv, d_v\) must have the same tokens"),
    ("d_k = 0", lambda: (_p(6, d=0), _p(6, H_KV, 0), _p(6, H_KV)), [0, 3, 6], {},
     ValueError, r"must share d_k >= 1"),
    ("h_kv does not divide h", lambda: (_p(6), _p(6, 3), _p(6, 3)), [0, 3, 6], {},
     ValueError, r"query heads h=4 must be a multiple of the key/value heads h_kv=3"),
    ("sparse q", lambda: (_p(6).to_sparse(), _p(6, H_KV), _p(6, H_KV)), [0, 3, 6], {},
     TypeError, r"^q must be a dense \(strided\) tensor"),
    ("dropout_p numpy 1", lambda: (_p(6), _p(6, H_KV), _p(6, H_KV)), [0, 3, 6],
     {"dropout_p": np.float32(1.0)}, ValueError, r"^dropout_p must lie in"),
    ("strategy None", lambda: (_p(6), _p(6, H_KV), _p(6, H_KV)), [0, 3, 6], {"strategy": None},
     ValueError, r"^strategy must be one of"),
]


@pytest.mark.parametrize("make, cu, kwargs, exc, pattern", [c[1:] for c in PACKED_REFUSALS],
                         ids=[c[0] for c in PACKED_REFUSALS])
def test_varlen_checks_its_inputs_whole(make, cu, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        mha.varlen_attention(*make(), cu, **kwargs)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"q": "sparse"}, r"^q must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    ({"mask": "sparse"}, r"^mask must be a dense \(strided\) bool tensor"),
], ids=["sparse q", "sparse mask"])
def test_sparse_layouts_are_named(kwargs, pattern):
    q, k, v = _qkv()
    mask = torch.ones(TQ, TK, dtype=torch.bool)
    if kwargs.get("q"):
        q = q.to_sparse()
    if kwargs.get("mask"):
        mask = mask.to_sparse()
    with pytest.raises(TypeError, match=pattern):
        mha.attention(q, k, v, mask=mask)


# ----------------------------------------------------------------------------- KVCache

KV_ARGS = dict(batch_size=2, num_kv_heads=2, max_len=8, head_dim=4, v_head_dim=4)
KV_REFUSALS = [(name, bad, exc) for name in KV_ARGS
               for bad, exc in ((0, ValueError), (-1, ValueError), (2.0, TypeError),
                                (True, TypeError), ("4", TypeError), (np.float32(4), TypeError))]


@pytest.mark.parametrize("name, bad, exc", KV_REFUSALS,
                         ids=[f"{n}={b!r}" for n, b, _ in KV_REFUSALS])
def test_kv_cache_sizes_are_checked(name, bad, exc):
    with pytest.raises(exc, match=rf"^{name} must be a positive int"):
        mha.KVCache(**{**KV_ARGS, name: bad})


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.complex64, torch.bool, "float32"])
def test_kv_cache_dtype_is_floating(dtype):
    with pytest.raises(TypeError, match=r"^dtype must be None or a floating dtype"):
        mha.KVCache(**KV_ARGS, dtype=dtype)


def test_kv_cache_accepts_numpy_sizes():
    c = mha.KVCache(*(np.int64(v) for v in KV_ARGS.values()))
    assert c.k.shape == (2, 2, 8, 4) and c.v.shape == (2, 2, 8, 4)


def _cache_with_prompt(lengths=(3, 3)):
    c = mha.KVCache(**KV_ARGS)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        c.append(torch.randn(2, 2, max(lengths), 4, generator=g),
                 torch.randn(2, 2, max(lengths), 4, generator=g))
    c.truncate(torch.tensor(lengths))
    return c


def _cache_state(c):
    return _snapshot(c.k, c.v, c.lengths, c.starts)


LEFT_PADDING_REFUSALS = [
    ("longer than the prompt", 4, ValueError, r"mark_left_padding: n must lie in .* lengths \[3, 2\]"),
    ("one row longer", [1, 3], ValueError, r"mark_left_padding: n must lie in"),
    ("negative", -1, ValueError, r"mark_left_padding: n must lie in"),
    ("past T_max", 9, ValueError, r"mark_left_padding: n must lie in \[0, T_max=8\]"),
    ("wrong shape", [1, 1, 1], ValueError, r"n must be an int or have shape \(B,\) = \(2,\)"),
    ("float", 1.0, TypeError, r"n must be an integer tensor"),
    ("float tensor", torch.tensor([1.0, 1.0]), TypeError, r"n must be an integer tensor .*float32"),
    ("complex", torch.tensor([1j, 0]), TypeError, r"n must be an integer tensor .*complex"),
    ("bool", torch.tensor([True, False]), TypeError, r"n must be an integer tensor .*bool"),
    ("string", "1", TypeError, r"n must be an integer tensor"),
]


@pytest.mark.parametrize("n, exc, pattern", [c[1:] for c in LEFT_PADDING_REFUSALS],
                         ids=[c[0] for c in LEFT_PADDING_REFUSALS])
def test_mark_left_padding_refusals_leave_the_cache_unchanged(n, exc, pattern):
    c = _cache_with_prompt((3, 2))
    before = _cache_state(c)
    with pytest.raises(exc, match=pattern):
        c.mark_left_padding(n)
    assert _same(before, _cache_state(c))


def test_left_padded_prompt_may_be_prefilled_in_chunks_shorter_than_the_padding():
    """mark_left_padding on an empty cache is bounded by T_max only: a first chunk that lies
    inside the padding is legitimate, and the real tokens get the one-shot prefill's result."""
    m = mha.MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 8, 16)  # (B, T_pad, d_model), 5 padding tokens then 3 real ones
    with torch.no_grad():
        one = m.new_cache(2, 12)
        one.mark_left_padding(5)
        want = m(x, cache=one)[:, 5:]
        chunked = m.new_cache(2, 12)
        chunked.mark_left_padding(5)
        m(x[:, :3], cache=chunked)
        got = m(x[:, 3:], cache=chunked)[:, 2:]
    torch.testing.assert_close(got, want)
    assert torch.equal(chunked.lengths, one.lengths) and torch.equal(chunked.starts, one.starts)


@pytest.mark.parametrize("Tn, exc", [(1.5, TypeError), (-1, ValueError), (torch.tensor(2), TypeError)])
def test_cache_positions_takes_a_count(Tn, exc):
    with pytest.raises(exc, match=r"^Tn must be a non-negative int"):
        mha.KVCache(**KV_ARGS).positions(Tn)


def test_left_padding_within_the_prompt_is_accepted():
    c = _cache_with_prompt((3, 2))
    c.mark_left_padding(np.array([3, 1]))
    assert c.starts.tolist() == [3, 1]
    c = mha.KVCache(**KV_ARGS)
    c.mark_left_padding(8)  # an empty cache: any padding up to T_max
    assert c.starts.tolist() == [8, 8]


MODULE_CALL_REFUSALS = [
    # (id, forward kwargs, exception, pattern)
    ("causal string", dict(causal="yes"), TypeError, r"^causal must be a bool .*got str"),
    ("causal int", dict(causal=1), TypeError, r"^causal must be a bool .*got int"),
    ("need_weights string", dict(need_weights="yes"), TypeError,
     r"^need_weights must be a bool .*got str"),
]


@pytest.mark.parametrize("with_cache", [False, True], ids=["plain", "cached"])
@pytest.mark.parametrize("kwargs, exc, pattern", [c[1:] for c in MODULE_CALL_REFUSALS],
                         ids=[c[0] for c in MODULE_CALL_REFUSALS])
def test_module_call_refusals_name_the_argument(with_cache, kwargs, exc, pattern):
    m = mha.MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 3, 16)  # (B, T, d_model)
    cache = m.new_cache(2, 8) if with_cache else None
    with pytest.raises(exc, match=pattern), torch.no_grad():
        m(x, cache=cache, **kwargs)
    if cache is not None:
        assert cache.lengths.tolist() == [0, 0]


@pytest.mark.parametrize("cache", ["cache", 8, {"k": None}], ids=["str", "int", "dict"])
def test_module_call_names_a_cache_that_is_not_one(cache):
    m = mha.MultiHeadAttention(16, 4).eval()
    with pytest.raises(TypeError, match=r"^cache must be a KV cache .*got " + type(cache).__name__):
        m(torch.randn(2, 3, 16), cache=cache)


# ----------------------------------------------------------------------------- module constructor

MODULE_REFUSALS = [
    ("bias string", dict(bias="no"), TypeError, r"^bias must be a bool .*got str"),
    ("bias int", dict(bias=0), TypeError, r"^bias must be a bool .*got int"),
    ("dropout string", dict(dropout="0.1"), TypeError, r"^dropout must be a number, got str"),
    ("dropout nan", dict(dropout=float("nan")), ValueError, r"^dropout must lie in"),
    ("dropout negative numpy", dict(dropout=np.float32(-0.5)), ValueError, r"^dropout must lie in"),
    ("dropout tensor", dict(dropout=torch.tensor(0.1)), TypeError, r"^dropout must be a number"),
    ("num_heads float", dict(num_heads=4.0), TypeError, r"^num_heads must be a positive int, got float"),
    ("num_heads bool", dict(num_heads=True), TypeError, r"^num_heads must be a positive int, got bool"),
    ("num_kv_heads 0", dict(num_kv_heads=0), ValueError, r"^num_kv_heads must be a positive int, got 0"),
    ("head_dim string", dict(head_dim="4"), TypeError, r"^head_dim must be a positive int, got str"),
    ("v_head_dim 0", dict(v_head_dim=0), ValueError, r"^v_head_dim must be a positive int, got 0"),
    ("kdim negative", dict(kdim=-3), ValueError, r"^kdim must be a positive int, got -3"),
    ("vdim numpy float", dict(vdim=np.float64(8)), TypeError, r"^vdim must be a positive int"),
    ("dtype int", dict(dtype=torch.int32), TypeError, r"^dtype must be None or a floating dtype"),
    ("dtype complex", dict(dtype=torch.complex64), TypeError, r"^dtype must be None or a floating"),
]


@pytest.mark.parametrize("kwargs, exc, pattern", [c[1:] for c in MODULE_REFUSALS],
                         ids=[c[0] for c in MODULE_REFUSALS])
def test_module_constructor_refusals(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        mha.MultiHeadAttention(**{"d_model": 16, "num_heads": 4, **kwargs})


def test_module_constructor_accepts_numpy_scalars():
    a = mha.MultiHeadAttention(np.int64(16), np.int32(4), num_kv_heads=np.int64(2),
                               bias=np.bool_(False), dropout=np.float64(0.25))
    b = mha.MultiHeadAttention(16, 4, num_kv_heads=2, bias=False, dropout=0.25)
    assert a.extra_repr() == b.extra_repr()
    assert all(type(getattr(a, n)) is int for n in ("d_model", "num_heads", "num_kv_heads"))
    assert type(a.dropout) is float and a.out_proj.bias is None


# ----------------------------------------------------------------------------- per-head weights

def _module(bias=True, packed=True):
    torch.manual_seed(3)
    extra = {} if packed else dict(kdim=10, vdim=6)
    return mha.MultiHeadAttention(16, 4, num_kv_heads=2, v_head_dim=3, bias=bias, **extra)


def _weights_state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def _edit(weights, key, fn):
    w = dict(weights)
    w[key] = fn(w[key])
    return w


def _pop(weights, key):
    w = dict(weights)
    del w[key]
    return w


PER_HEAD_REFUSALS = [
    # (id, module has bias, edit of the weights of per_head_weights(), exception, pattern)
    ("W_o wrong shape", True, lambda w: _edit(w, "W_o", lambda t: t[:-1]), ValueError,
     r"^W_o must have shape \(12, 16\), got \(11, 16\)"),
    ("b_o wrong shape", True, lambda w: _edit(w, "b_o", lambda t: t[:3]), ValueError, r"^b_o must have shape"),
    ("last W_v head wrong", True, lambda w: _edit(w, "W_v", lambda ts: ts[:-1] + [ts[-1][:, :2]]),
     ValueError, r"^W_v\[1\] must have shape \((16|6), 3\)"),  # (vdim, d_v)
    ("too few W_q", True, lambda w: _edit(w, "W_q", lambda ts: ts[:3]), ValueError,
     r"^W_q must hold 4 tensors"),
    ("too many W_k", True, lambda w: _edit(w, "W_k", lambda ts: ts + ts[:1]), ValueError,
     r"^W_k must hold 2 tensors"),
    ("W_k a tensor", True, lambda w: _edit(w, "W_k", lambda ts: torch.stack(ts)), TypeError,
     r"^W_k must be a list of 2 tensors"),
    ("complex W_o", True, lambda w: _edit(w, "W_o", lambda t: t.to(torch.complex64)), TypeError,
     r"^W_o must be a real tensor"),
    ("bool b_v", True, lambda w: _edit(w, "b_v", lambda ts: [t > 0 for t in ts]), TypeError,
     r"^b_v\[0\] must be a real tensor"),
    ("list as a head", True, lambda w: _edit(w, "W_q", lambda ts: ts[:-1] + [ts[-1].tolist()]),
     TypeError, r"^W_q\[3\] must be a torch.Tensor"),
    ("missing W_o", True, lambda w: _pop(w, "W_o"), ValueError, r"^weights: missing \['W_o'\]"),
    ("missing biases", True, lambda w: _pop(_pop(w, "b_q"), "b_o"), ValueError,
     r"^weights: missing \['b_o', 'b_q'\]"),
    ("biases set to None", True, lambda w: _edit(w, "b_k", lambda _: None), TypeError,
     r"^b_k must be a list of 2 tensors"),
    ("biases for a bias-free module", False,
     lambda w: {**w, "b_o": torch.zeros(16)}, ValueError, r"unexpected \['b_o'\] \(this module has no biases\)"),
    ("unknown key", True, lambda w: {**w, "W_x": torch.zeros(1)}, ValueError, r"unexpected \['W_x'\]"),
    ("not a dict", True, lambda w: list(w.items()), TypeError, r"^weights must be a dict"),
]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
@pytest.mark.parametrize("bias, edit, exc, pattern", [c[1:] for c in PER_HEAD_REFUSALS],
                         ids=[c[0] for c in PER_HEAD_REFUSALS])
def test_load_per_head_weights_is_all_or_nothing(packed, bias, edit, exc, pattern):
    m = _module(bias, packed)
    donor = _module(bias, packed)
    torch.nn.init.normal_(donor.out_proj.weight)  # new values everywhere but the defect
    for p in donor.parameters():
        p.data.add_(1.0)
    weights = donor.per_head_weights()
    before = _weights_state(m)
    with pytest.raises(exc, match=pattern):
        m.load_per_head_weights(edit(weights))
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


STATE_DICT_REFUSALS = [
    # (id, edit of the state dict, pattern)
    ("one weight of the wrong shape", lambda sd: {**sd, "out_proj.weight": torch.zeros(3, 3)},
     r"out_proj.weight must have shape \(16, 12\), got \(3, 3\)"),
    ("a bias as a list", lambda sd: {**sd, "out_proj.bias": [0.0] * 16},
     r"out_proj.bias must be a tensor, got list"),
    ("a complex weight", lambda sd: {**sd, "out_proj.weight": sd["out_proj.weight"].to(torch.complex64)},
     r"out_proj.weight must be a real tensor"),
    ("a bool bias", lambda sd: {**sd, "out_proj.bias": sd["out_proj.bias"] > 0},
     r"out_proj.bias must be a real tensor"),
]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
@pytest.mark.parametrize("nested", [False, True], ids=["alone", "in a Sequential"])
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("edit, pattern", [c[1:] for c in STATE_DICT_REFUSALS],
                         ids=[c[0] for c in STATE_DICT_REFUSALS])
def test_load_state_dict_is_all_or_nothing(packed, nested, strict, edit, pattern):
    m = _module(True, packed)
    donor = _module(True, packed)
    for p in donor.parameters():  # new values in every tensor, the defect in one
        p.data.add_(1.0)
    holder, donor_holder = (torch.nn.Sequential(m), torch.nn.Sequential(donor)) if nested \
        else (m, donor)
    prefix = "0." if nested else ""
    sd = {k.removeprefix(prefix): t for k, t in donor_holder.state_dict().items()}
    sd = {prefix + k: t for k, t in edit(sd).items()}
    before = _weights_state(m)
    with pytest.raises(ValueError, match=pattern) as refused:
        holder.load_state_dict(sd, strict=strict)
    assert isinstance(refused.value, RuntimeError)  # what nn.Module raises, for old callers
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("bias", [True, False])
def test_load_per_head_weights_round_trip(bias):
    a, b = _module(bias), _module(bias)
    for p in a.parameters():
        p.data.add_(1.0)
    w = a.per_head_weights()
    if not bias:
        assert w["b_q"] is None  # the None biases of a bias-free module load back
    b.load_per_head_weights(w)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(),
                                                 strict=True))


# ----------------------------------------------------------------------------- distributed

W_DIST = 2
# (id, what rank 1 passes instead of rank 0's (q, k, v) / kwargs, function names to call)
DIST_CASES = [
    ("dtype", lambda q, k, v: (q.bfloat16(), k.bfloat16(), v.bfloat16()), {}),
    ("h", lambda q, k, v: (q[:, :2], k, v), {}),
    ("h_kv", lambda q, k, v: (q, k[:, :1], v[:, :1]), {}),
    ("d_k", lambda q, k, v: (q[..., :4], k[..., :4], v), {}),
    ("d_v", lambda q, k, v: (q, k, v[..., :4]), {}),
    ("B", lambda q, k, v: (q[:1], k[:1], v[:1]), {}),
    ("n_k", lambda q, k, v: (q, k[:, :, :3], v[:, :, :3]), {}),
    ("causal", lambda q, k, v: (q, k, v), {"causal": True}),
    ("scale", lambda q, k, v: (q, k, v), {"scale": 0.5}),
    ("layout", lambda q, k, v: (q, k, v), {"layout": "zigzag"}),
]
DIST_LOCAL = [  # refused on rank 1 alone
    ("int q", lambda q, k, v: (q.int(), k, v), {}, TypeError),
    ("d_k = 0", lambda q, k, v: (q[..., :0], k[..., :0], v), {}, ValueError),
    ("causal string", lambda q, k, v: (q, k, v), {"causal": "yes"}, TypeError),
    ("scale nan", lambda q, k, v: (q, k, v), {"scale": float("nan")}, ValueError),
    ("layout unknown", lambda q, k, v: (q, k, v), {"layout": "spiral"}, ValueError),
    ("window without causal", lambda q, k, v: (q, k, v), {"window": 2}, ValueError),
]


def _dist_worker(rank: int, init_file: str, out_dir: str) -> None:
    import datetime
    import json

    import torch.distributed as dist

    from mha import distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=W_DIST, timeout=datetime.timedelta(seconds=60))
    messages = {}
    try:
        g = torch.Generator().manual_seed(5)
        base = (torch.randn(2, 4, 4, 8, generator=g), torch.randn(2, 2, 4, 8, generator=g),
                torch.randn(2, 2, 4, 8, generator=g))  # (B, h, n_q, d_k), (B, h_kv, n_k, d)
        fns = {"ring": distributed.ring_attention,
               "context": distributed.context_parallel_attention}
        with torch.no_grad():
            want = {name: fn(*base) for name, fn in fns.items()}
            for case, change, kwargs in DIST_CASES:
                args, kw = (change(*base), kwargs) if rank == 1 else (base, {})
                for name, fn in fns.items():
                    with pytest.raises(ValueError, match="same shapes on every rank, and the same dtype") as e:
                        fn(*args, **kw)
                    messages[f"{case} {name}"] = str(e.value)
            for case, change, kwargs, exc in DIST_LOCAL:
                args, kw = (change(*base), kwargs) if rank == 1 else (base, {})
                for name, fn in fns.items():
                    with pytest.raises(exc if rank == 1 else ValueError) as e:
                        fn(*args, **kw)
                    if rank == 0:
                        assert "refused on rank(s) [1]" in str(e.value), f"{case} {name}"
            kw = {"dropout_p": 2.0} if rank == 1 else {}  # refused on rank 1 alone, before any gather
            with pytest.raises(ValueError, match="dropout_p must lie in" if rank == 1 else "refused on"):
                distributed.context_parallel_attention(*base, **kw)
        # a ring call with grad on one rank only (its backward would wait for the others
        # forever): refused on every rank, nothing sent
        q = base[0].clone().requires_grad_(rank == 1)
        with pytest.raises(ValueError, match="requires_grad=True"):
            distributed.ring_attention(q, *base[1:])
        # the group still works, with the same results as before the refusals
        with torch.no_grad():
            for name, fn in fns.items():
                assert torch.equal(fn(*base), want[name]), name
    finally:
        dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(messages, f)


def test_distributed_ranks_that_disagree_all_raise_the_same_error(tmp_path):
    import json

    import torch.multiprocessing as mp

    mp.spawn(_dist_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=W_DIST,
             join=True)
    views = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(W_DIST)]
    assert len(views[0]) == 2 * len(DIST_CASES)
    assert views[0] == views[1]  # the same message on every rank
    assert "bfloat16" in views[0]["dtype ring"] and "causal=True" in views[0]["causal context"]
