"""Hostile use of the library API: calls a careless or malicious user makes on the paged and
dense K/V caches (and transformers' cache over them), the module's state dict and packed
mode, ``mha.linear``, ``mha.distributed``'s layout helpers, ``mha.trace`` and ``mha.io``. Each
is refused at the boundary with an error naming the argument and leaves every piece of state
as it was, or gives the answer of the reference it mirrors.

Shape legend: N packed tokens, B batch, h / h_kv query / K/V heads, Tq queries, d head dim,
p page size, M / K / N a GEMM's rows / inner size / columns.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mha
from mha.distributed import layout
from mha.models import TinyDecoder

H, H_KV, D = 4, 2, 8


def _rows(n, seed, d=D):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H_KV, d, generator=g), torch.randn(n, H_KV, d, generator=g)


def _same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, name


# ------------------------------------------------------------------ PagedKVCache: fork + write
def _forked(length, page_size, layers=1):
    """A cache holding sequence ``a`` of ``length`` tokens and its fork ``b`` (pages shared)."""
    c = mha.PagedKVCache(16, page_size, H_KV, D, max_seqs=4, max_len=32, num_layers=layers)
    a = c.add_sequence()
    with torch.no_grad():
        c.extend([a], [length])
        for layer in range(layers):
            c.write(layer, [a], *_rows(length, layer), cu_seqlens=[0, length])
    return c, a, c.fork(a)


@pytest.mark.parametrize("length,page_size", [(3, 4), (4, 4), (6, 4), (1, 1)])
def test_a_write_into_pages_shared_by_a_fork_is_refused_unchanged(length, page_size):
    """write stores the last n positions of a sequence; after a fork those lie in pages the
    other sequence holds too, and writing them would change that sequence's tokens."""
    c, a, b = _forked(length, page_size)
    before = c.state()
    for writer in (a, b):
        with torch.no_grad(), pytest.raises(ValueError, match=r"write: .*shared with"):
            c.write(0, [writer], *_rows(1, 9))
        _same_state(before, c.state())


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 9), page_size=st.sampled_from([1, 2, 4]),
       grow=st.lists(st.tuples(st.booleans(), st.integers(0, 5)), min_size=1, max_size=4),
       writes=st.lists(st.tuples(st.booleans(), st.integers(1, 3)), min_size=1, max_size=4))
def test_a_fork_and_its_parent_never_see_each_others_writes(length, page_size, grow, writes):
    """Any mix of extends and writes on a sequence and its fork: each keeps the tokens it was
    given (a list model of each), whatever was refused along the way."""
    c, a, b = _forked(length, page_size)
    k0, v0 = _rows(length, 0)
    model = {s: [(k0[i], v0[i]) for i in range(length)] for s in (a, b)}
    seed = 100
    with torch.no_grad():
        for (on_b, n), (w_on_b, m) in zip(grow, writes, strict=False):
            s = b if on_b else a
            k, v = _rows(n, seed)
            seed += 1
            try:
                c.extend([s], [n])
            except mha.PagePoolExhausted:
                continue
            c.write(0, [s], k, v, cu_seqlens=[0, n])
            model[s] += [(k[i], v[i]) for i in range(n)]
            s = b if w_on_b else a
            m = min(m, int(c.lengths[s]))
            k, v = _rows(m, seed)
            seed += 1
            try:  # a rewrite of the last m tokens: refused where a page is shared
                c.write(0, [s], k, v, cu_seqlens=[0, m])
            except ValueError as e:  # that refusal, and no other
                assert "shared with another sequence" in str(e), str(e)
                continue
            model[s][len(model[s]) - m:] = [(k[i], v[i]) for i in range(m)]
    for s in (a, b):
        kg, vg = c.gather(0, s)  # (1, h_kv, n, d)
        want_k = torch.stack([r[0] for r in model[s]], dim=1)  # n x (h_kv, d) -> (h_kv, n, d)
        want_v = torch.stack([r[1] for r in model[s]], dim=1)
        assert torch.equal(kg[0], want_k) and torch.equal(vg[0], want_v), s


def test_extend_then_write_of_every_layer_after_a_fork_is_served():
    """The documented order (extend once, then write each layer) writes private pages only."""
    c, a, b = _forked(3, 4, layers=2)
    with torch.no_grad():
        c.extend([a, b], [2, 1])
        for layer in range(2):
            c.write(layer, [a, b], *_rows(3, 10 + layer), cu_seqlens=[0, 2, 3])
    assert c.lengths[[a, b]].tolist() == [5, 4]
    ka, _ = c.gather(0, a)
    kb, _ = c.gather(0, b)
    assert torch.equal(ka[0, :, :3], kb[0, :, :3])  # the shared prefix, as written once


# ------------------------------------------------------------------ load_state_dict
def _module_and_new_weights(seed=1):
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(16, 4, sinks=True)
    g = torch.Generator().manual_seed(seed)
    new = {k: torch.randn(v.shape, generator=g) for k, v in m.state_dict().items()}
    return m, new


@pytest.mark.parametrize("how,words", [
    ("meta", r"out_proj.bias .*meta"),
    ("sparse", r"out_proj.bias .*dense"),
])
def test_a_state_dict_entry_without_data_is_refused_before_any_copy(how, words):
    """nn.Module copies entries in order and raises at the first one it cannot copy; the
    entries before it must not have been loaded."""
    m, new = _module_and_new_weights()
    new["out_proj.bias"] = (new["out_proj.bias"].to("meta") if how == "meta"
                            else new["out_proj.bias"].to_sparse())
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match=words):
        m.load_state_dict(new)
    _same_state(before, m.state_dict())


@pytest.mark.parametrize("change,words", [
    ({"out_proj.bias": torch.float64}, r"assign=True.*one dtype.*out_proj.bias.*float64"),
    ({"in_proj.weight": torch.bfloat16}, r"assign=True.*one dtype.*in_proj.weight.*bfloat16"),
    ({"out_proj.weight": torch.int64}, r"out_proj.weight must be floating with assign=True"),
])
def test_assign_refuses_entries_that_would_leave_mixed_or_integer_weights(change, words):
    """load_state_dict(assign=True) keeps each entry's dtype: one of another dtype than the
    rest would make every later forward fail inside a GEMM (or, integer, inside torch's
    assignment after the earlier entries were assigned)."""
    m, new = _module_and_new_weights()
    for name, dtype in change.items():
        new[name] = new[name].to(dtype)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match=words):
        m.load_state_dict(new, assign=True)
    _same_state(before, m.state_dict())
    assert {v.dtype for v in m.state_dict().values()} == {torch.float32}


def test_assign_of_one_dtype_for_every_entry_is_taken():
    m, new = _module_and_new_weights()
    m.load_state_dict({k: v.double() for k, v in new.items()}, assign=True)
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    assert m(x).dtype == torch.float64
    assert torch.equal(m.out_proj.weight, new["out_proj.weight"].double())


# ------------------------------------------------------------------ KVCache.attend
def _kv_cache(kv_dtype=None, Tn=3):
    c = mha.KVCache(2, H_KV, 16, D, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        c.append(torch.randn(2, H_KV, Tn, D, generator=g), torch.randn(2, H_KV, Tn, D, generator=g))
    return c


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_kv_cache_attend_refuses_queries_of_another_dtype(kv_dtype, dtype):
    """The int8 cache's decode kernel took bfloat16 queries for a float32 cache (and returned
    bfloat16); the dense cache refused them only as mha.attention's 'q, k, v' mismatch."""
    c = _kv_cache(kv_dtype)
    with pytest.raises(TypeError, match=r"^KVCache.attend: q must be torch.float32"):
        c.attend(torch.randn(2, H, 1, D, dtype=dtype))


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_kv_cache_attend_refuses_more_queries_than_cached_tokens(kv_dtype):
    """q holds the queries of the last Tq cached tokens; more than a row holds is a call
    whose K/V were never appended (PagedKVCache.attend refuses it the same way)."""
    c = _kv_cache(kv_dtype, Tn=3)
    with pytest.raises(ValueError, match=r"KVCache.attend: .*Tq=4 .*\[3, 3\]"):
        c.attend(torch.randn(2, H, 4, D))


@pytest.mark.parametrize("name,value", [
    ("causal", False), ("causal", True), ("key_lengths", torch.tensor([1, 1])),
    ("mask", torch.ones(1, dtype=torch.bool)), ("window", 2)])
@pytest.mark.parametrize("Tq", [1, 2])
def test_kv_cache_attend_refuses_the_masks_it_sets_itself(name, value, Tq):
    """causal, key_lengths, mask and window are the cache's own: passing one is a TypeError
    naming it, for any Tq (key_lengths with Tq = 1 would replace the cache's row lengths)."""
    c = _kv_cache()
    with pytest.raises(TypeError, match=rf"KVCache.attend: {name} is set by the cache"):
        c.attend(torch.randn(2, H, Tq, D), **{name: value})


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_kv_cache_attend_matches_the_reference(kv_dtype):
    c = _kv_cache(kv_dtype, Tn=5)
    q = torch.randn(2, H, 2, D, generator=torch.Generator().manual_seed(3))
    out = c.attend(q, softcap=5.0, sinks=torch.zeros(H))
    allowed = torch.ones(2, 5, dtype=torch.bool).tril(diagonal=3)  # (Tq, Tk) bottom right
    ref, _ = mha.reference.attention(q, c.keys(), c.values(), allowed=allowed, upcast=True,
                                     softcap=5.0, sinks=torch.zeros(H))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ PagedKVCache.attend_varlen
def _prefilled(lengths=(5, 3)):
    c = mha.PagedKVCache(16, 4, H_KV, D, max_seqs=4, max_len=32)
    seqs = [c.add_sequence() for _ in lengths]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    with torch.no_grad():
        c.append(seqs, *_rows(cu[-1], 0), cu_seqlens=cu)
    return c, seqs, cu


@pytest.mark.parametrize("q_shape,variants,err,words", [
    ((8, 3, D), {}, ValueError, r"attend_varlen: q .*h=3 .*multiple of h_kv=2"),
    ((8, H, 5), {}, ValueError, r"attend_varlen: q .*d_k=8"),
    ((8, H, D), {"sinks": torch.zeros(3)}, ValueError, r"sinks must have shape \(h,\) = \(4,\)"),
    ((8, H, D), {"sinks": torch.zeros(H, dtype=torch.int64)}, TypeError, r"sinks must be"),
    ((8, H, D), {"softcap": -1.0}, ValueError, r"softcap must"),
    ((8, H, D), {"softcap": 0.0}, ValueError, r"softcap must be > 0"),
    ((8, H, D), {"scale": float("nan")}, ValueError, r"scale must"),
    ((8, H, D), {"scale": -1.0}, ValueError, r"scale must"),
])
def test_attend_varlen_checks_q_and_its_variants_at_the_boundary(q_shape, variants, err, words):
    """attend_varlen checks q and its variants itself, as mha.attention does (errors naming
    the argument, the cache unchanged): a NaN or negative scale is refused, not attended."""
    c, seqs, cu = _prefilled()
    before = c.state()
    with torch.no_grad(), pytest.raises(err, match=words):
        c.attend_varlen(0, torch.randn(q_shape), seqs, cu, **variants)
    _same_state(before, c.state())


def test_attend_varlen_takes_sinks_as_mha_attention_does():
    """bfloat16 or strided sinks, which mha.attention takes, are taken here too."""
    c, seqs, cu = _prefilled()
    q = torch.randn(8, H, D, generator=torch.Generator().manual_seed(5))  # (N, h, d_k)
    sinks = torch.randn(2 * H, generator=torch.Generator().manual_seed(6))[::2]  # (h,) strided
    with torch.no_grad():
        out = c.attend_varlen(0, q, seqs, cu, sinks=sinks, softcap=4.0)
        out_bf16 = c.attend_varlen(0, q, seqs, cu, sinks=sinks.bfloat16())
    for i, s in enumerate(seqs):
        k, v = c.gather(0, s)  # (1, h_kv, n, d)
        qs = q[cu[i]:cu[i + 1]].transpose(0, 1).unsqueeze(0)  # (n, h, d) -> (1, h, n, d)
        ref, _ = mha.reference.attention(qs, k, v, allowed=torch.ones(qs.shape[2], k.shape[2],
                                         dtype=torch.bool).tril(k.shape[2] - qs.shape[2]),
                                         upcast=True, sinks=sinks, softcap=4.0)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], ref[0].transpose(0, 1),
                                   atol=1e-5, rtol=1e-5)
    ref_bf16 = c.attend_varlen(0, q, seqs, cu, sinks=sinks.bfloat16().float())
    torch.testing.assert_close(out_bf16, ref_bf16)


@pytest.mark.parametrize("q_shape,words", [((2, 3, 1, D), r"h=3 .*multiple of h_kv=2"),
                                           ((2, H, 1, 5), r"d_k=8")])
def test_paged_attend_names_q_when_its_heads_do_not_fit_the_pages(q_shape, words):
    c, seqs, _ = _prefilled()
    with torch.no_grad(), pytest.raises(ValueError, match=rf"^attend: q .*{words}"):
        c.attend(0, torch.randn(q_shape), seqs)


# ------------------------------------------------------------------ mha.linear.linear
@pytest.mark.parametrize("side", ["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias_shape", [(1, 256), (), (1,), (64, 256)])
def test_linear_takes_every_bias_f_linear_takes_on_either_gemm(monkeypatch, side, dtype,
                                                                bias_shape):
    """linear is F.linear on whichever GEMM was measured faster: every bias F.linear adds
    (broadcastable to the output) is taken on either side, so whether a call runs does not
    depend on the measured choice."""
    from mha.linear import linear
    from mha.ops import linear_choice

    monkeypatch.setenv(linear_choice.ENV, side)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g).to(dtype)  # (M, K)
    w = torch.randn(256, 512, generator=g).to(dtype)  # (N, K)
    b = torch.randn(bias_shape, generator=g).to(dtype)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())  # (M, N)
    tol = 1e-4 if dtype == torch.float32 else 0.5
    torch.testing.assert_close(linear(x, w, b).double(), want, atol=tol, rtol=tol / 10)


@pytest.mark.parametrize("side", ["native", "torch"])
def test_linear_refuses_a_bias_f_linear_refuses_on_either_gemm(monkeypatch, side):
    from mha.linear import linear
    from mha.ops import linear_choice

    monkeypatch.setenv(linear_choice.ENV, side)
    x, w = torch.randn(64, 512), torch.randn(256, 512)  # (M, K), (N, K)
    with pytest.raises(RuntimeError, match="size of tensor a .* must match|expanded size"):
        linear(x, w, torch.randn(255))


# ------------------------------------------------------------------ mha.distributed layouts
X = torch.arange(2 * 8.0).view(1, 2, 8, 1)  # (B, h, T, d)


@pytest.mark.parametrize("call,err,words", [
    (lambda: layout.shard(X, 0, 0), ValueError, r"world must be a positive int, got 0"),
    (lambda: layout.shard(X, True, 0), TypeError, r"world must be a positive int, got bool"),
    (lambda: layout.shard(X, 2, 2), ValueError, r"rank must lie in \[0, 2\) \(world=2\), got 2"),
    (lambda: layout.shard(X, 2, -1), ValueError, r"rank must lie in \[0, 2\)"),
    (lambda: layout.shard(X, 2, 0, dim=4), ValueError, r"dim must lie in \[-4, 4\) .*got 4"),
    (lambda: layout.shard([1, 2], 2, 0), TypeError, r"x must be a torch.Tensor"),
    (lambda: layout.positions(-4, 2, 0), ValueError, r"T must be a non-negative int, got -4"),
    (lambda: layout.positions(8.0, 2, 0), TypeError, r"T must be a non-negative int"),
    (lambda: layout.visible_pairs(8, 8, 0), ValueError, r"world must be a positive int, got 0"),
])
def test_layout_helpers_name_the_bad_argument(call, err, words):
    """Each helper names the bad argument: world = 0, rank >= world, a dim x lacks, T < 0 or
    not an int."""
    with pytest.raises(err, match=words):
        call()


@pytest.mark.parametrize("lay", ["contiguous", "zigzag"])
def test_layout_shards_are_a_partition_of_the_rows(lay):
    W = 2
    parts = [layout.shard(X, W, r, layout=lay, dim=-2) for r in range(W)]
    got = layout.from_rank_order(torch.cat(parts, dim=2), W, layout=lay)
    assert torch.equal(got, X)


# ------------------------------------------------------------------ mha.trace
@pytest.mark.parametrize("kwargs,err,words", [
    ({"need_weights": False}, TypeError, r"^trace: need_weights is set by trace"),
    ({"cu_seqlens": torch.tensor([0, 3, 6])}, ValueError,
     r"^trace: .*packed sequences \(cu_seqlens\) return none"),
])
def test_trace_names_the_keyword_it_cannot_take(kwargs, err, words):
    """trace refuses the keywords it cannot take, naming them as the caller passed them:
    need_weights (trace sets it) and cu_seqlens (packed sequences return no weights)."""
    m = mha.MultiHeadAttention(16, 4)
    with pytest.raises(err, match=words):
        mha.trace(m, torch.randn(1, 6, 16), **kwargs)


# ------------------------------------------------------------------ mha.io
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_io_round_trip_keeps_the_module_dtype(tmp_path, dtype):
    """load(path) without dtype built the module in torch's default dtype: a saved bfloat16
    module came back float32 (twice the memory, other numbers) without a word."""
    m = mha.MultiHeadAttention(16, 4, sinks=True).to(dtype)
    path = tmp_path / "m.safetensors"
    mha.io.save(m, path)
    back = mha.io.load(path)
    assert {t.dtype for t in back.state_dict().values()} == {dtype}
    _same_state(m.state_dict(), back.state_dict())
    assert mha.io.load(path, dtype=torch.float32).out_proj.weight.dtype == torch.float32


@pytest.mark.parametrize("seq_ids", [torch.tensor(0), 0, None, {0}, (s for s in [0])],
                         ids=["0-d tensor", "int", "None", "set", "generator"])
@pytest.mark.parametrize("method", ["extend", "append", "attend", "attend_varlen"])
def test_paged_seq_ids_of_the_wrong_kind_are_named(seq_ids, method):
    """seq_ids must be a list (or tuple, 1-D tensor) of ids: a bare id, a 0-d tensor, None, a
    set (no order to pair with counts or q's rows) and a generator are refused by every call
    with a TypeError naming seq_ids, the cache unchanged."""
    c, seqs, cu = _prefilled()
    before = c.state()
    calls = {"extend": lambda: c.extend(seq_ids, [1]),
             "append": lambda: c.append(seq_ids, *_rows(1, 3)),
             "attend": lambda: c.attend(0, torch.randn(1, H, 1, D), seq_ids),
             "attend_varlen": lambda: c.attend_varlen(0, torch.randn(1, H, D), seq_ids, [0, 1])}
    with torch.no_grad(), pytest.raises(TypeError, match=r"^seq_ids must be a list .* got"):
        calls[method]()
    _same_state(before, c.state())


# ------------------------------------------------------------------ MultiHeadAttention
@pytest.mark.parametrize("cu", [torch.tensor([0, 4, 2, 6]), torch.tensor([1, 6]),
                                torch.tensor([0, 5]), torch.tensor([0, 2**32 + 3, 6])])
def test_module_names_cu_seqlens_as_the_caller_passed_it(cu):
    """A bad cu_seqlens given to module(x, cu_seqlens=...) is refused naming cu_seqlens, the
    argument the caller passed (not varlen_attention's cu_seqlens_q)."""
    m = mha.MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match=r"^cu_seqlens must start at 0"):
        m(torch.randn(1, 6, 16), cu_seqlens=cu)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_an_int8_cache_of_a_dtype_the_decode_kernel_lacks_is_attended(dtype):
    """KVCache(kv_dtype="int8", dtype=float16 / float64) attends (the decode kernel runs only
    float32 / bfloat16): the dequantized K/V serve those dtypes."""
    g = torch.Generator().manual_seed(0)
    c = mha.KVCache(2, H_KV, 8, D, dtype=dtype, kv_dtype="int8")
    c.append(torch.randn(2, H_KV, 3, D, generator=g).to(dtype),
             torch.randn(2, H_KV, 3, D, generator=g).to(dtype))
    q = torch.randn(2, H, 1, D, generator=g).to(dtype)  # (B, h, Tq, d_k)
    out = c.attend(q)
    assert out.dtype == dtype
    torch.testing.assert_close(out, mha.attention(q, c.keys(), c.values()))
    m = mha.MultiHeadAttention(16, 4).to(dtype).eval()
    x = torch.randn(2, 4, 16, generator=g).to(dtype)  # (B, T, d_model)
    cache = m.new_cache(2, 8, kv_dtype="int8")
    with torch.no_grad():
        steps = torch.cat([m(x[:, :3], cache=cache), m(x[:, 3:], cache=cache)], dim=1)
        full = m(x, causal=True)
    torch.testing.assert_close(steps, full, atol=2e-2, rtol=2e-2)


def test_a_float16_model_generates_with_an_int8_mha_cache():
    """transformers' generate with MhaCache(kv_dtype="int8") on a float16 model runs its decode
    steps (the decode kernel takes float32 / bfloat16 queries only)."""
    pytest.importorskip("transformers", reason="transformers not installed")
    import copy

    import mha.integrations.hf_cache as hc
    from tiny_llama import PROMPTS, eager_and_mha

    model = copy.deepcopy(eager_and_mha()["mha"]).to(torch.float16)
    ids, _ = PROMPTS["plain"]
    runs = {}
    for kv_dtype in (None, "int8"):
        cache = hc.MhaCache(model.config, max_cache_len=ids.shape[1] + 4, kv_dtype=kv_dtype)
        with torch.no_grad():
            out = model(input_ids=ids, cache=cache, use_cache=True)  # prefill
            step = model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
        runs[kv_dtype] = step.logits.float()  # (B, 1, V)
    torch.testing.assert_close(runs["int8"], runs[None], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_a_paged_cache_the_kernels_cannot_read_is_refused_when_built(dtype):
    """PagedKVCache(dtype=float16 / float64) with kv_dtype=None (pages in that dtype, which
    neither the decode kernel nor the paged forward reads) is refused when built, naming
    kv_dtype and the page dtypes the kernels read, before any K/V is written."""
    with pytest.raises(ValueError, match=rf"kv_dtype=None stores K/V in dtype={dtype}.*"
                                         r"'float32', 'bfloat16' or 'int8'"):
        mha.PagedKVCache(8, 4, H_KV, D, max_seqs=2, max_len=16, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_paged_float16_and_float64_queries_read_pages_they_can(dtype, kv_dtype):
    """float16 / float64 queries read pages of every kv_dtype, int8 included (the decode
    kernel takes float32 / bfloat16 queries; it computes in float32 either way)."""
    c = mha.PagedKVCache(8, 4, H_KV, D, max_seqs=2, max_len=16, dtype=dtype, kv_dtype=kv_dtype)
    s = c.add_sequence()
    k, v = _rows(5, 0)
    with torch.no_grad():
        c.append([s], k.to(dtype), v.to(dtype), cu_seqlens=[0, 5])
        q = torch.randn(1, H, 1, D, generator=torch.Generator().manual_seed(1)).to(dtype)
        out = c.attend(0, q, [s])  # (1, h, 1, d_v)
        rows = c.attend_varlen(0, q[0].transpose(0, 1), [s], [0, 1])  # (1, h, d_v)
    kg, vg = c.gather(0, s)  # (1, h_kv, 5, d), dequantized, in dtype
    ref = mha.attention(q.float(), kg.float(), vg.float())
    assert out.dtype == dtype and rows.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(rows.float(), ref[:, :, 0], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("variants", [
    {"bias": "rows"}, {"bias": "keys"}, {"alibi_slopes": "rows"}, {"alibi_slopes": "heads"},
    {"sinks": "heads", "softcap": 3.0}], ids=["bias (S', h, 1, M p)", "bias (M p,)",
                                             "alibi (S', h)", "alibi (h,)", "sinks+softcap"])
def test_paged_attend_without_the_kernel_takes_the_kernels_variants(monkeypatch, variants):
    """Where the decode kernel cannot be built, attend runs each sequence on its gathered K/V
    and takes every variant the kernel takes: a bias broadcast to (S', h, Tq, M * p) and
    (S', h) ALiBi slopes are split per sequence."""
    from mha.ops import decode

    c, seqs, _ = _prefilled((5, 3))
    S, Mp = len(seqs), c.max_len
    g = torch.Generator().manual_seed(2)
    make = {"bias": {"rows": torch.randn(S, H, 1, Mp, generator=g),
                     "keys": torch.randn(Mp, generator=g)},
            "alibi_slopes": {"rows": torch.rand(S, H, generator=g),
                             "heads": torch.rand(H, generator=g)},
            "sinks": {"heads": torch.randn(H, generator=g)}}
    kw = {n: make[n][v] if n in make else v for n, v in variants.items()}
    q = torch.randn(S, H, 1, D, generator=g)  # (S', h, 1, d_k)
    with torch.no_grad():
        native = c.attend(0, q, seqs, **kw) if decode.unavailable() is None else None
        monkeypatch.setattr(decode, "unavailable", lambda: "no compiler (test)")
        with mha.use_backend("math"):
            got = c.attend(0, q, seqs, **kw)  # (S', h, 1, d_v)
    for i, s in enumerate(seqs):
        k, v = c.gather(0, s)  # (1, h_kv, n, d)
        n = k.shape[2]
        row = dict(kw)
        if "bias" in row:
            b = row["bias"]
            row["bias"] = b[i:i + 1, ..., :n] if b.dim() == 4 else b[:n]
        if "alibi_slopes" in row and row["alibi_slopes"].dim() == 2:
            row["alibi_slopes"] = row["alibi_slopes"][i]
        want, _ = mha.reference.attention(q[i:i + 1], k, v, upcast=True, **row)
        torch.testing.assert_close(got[i:i + 1], want, atol=1e-5, rtol=1e-5)
    if native is not None:
        torch.testing.assert_close(got, native, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cu,err", [([0, 2.5], TypeError), (torch.tensor([0.0, 2.0]), TypeError),
                                    (2, TypeError), ([0, True], TypeError),
                                    (torch.tensor([[0, 2]]), TypeError)])
@pytest.mark.parametrize("method", ["write", "attend_varlen"])
def test_paged_cu_seqlens_of_the_wrong_kind_is_named(cu, err, method):
    """Float offsets, a bare int, bools and a 2-D tensor are refused naming cu_seqlens (not
    extend's counts), the cache unchanged."""
    c, seqs, _ = _prefilled((5, 3))
    before = c.state()
    calls = {"write": lambda: c.write(0, seqs[:1], *_rows(2, 4), cu),
             "attend_varlen": lambda: c.attend_varlen(0, torch.randn(2, H, D), seqs[:1], cu)}
    with torch.no_grad(), pytest.raises(err, match=r"^cu_seqlens must be"):
        calls[method]()
    _same_state(before, c.state())


# A device this torch cannot use: named at the boundary (torch's own error for "cuda:7" on a
# CPU build is an AssertionError from deep inside the first allocation).
_NO_SUCH_DEVICES = ["banana"] + ([] if torch.cuda.device_count() > 7 else ["cuda:7"])


@pytest.mark.parametrize("device", _NO_SUCH_DEVICES)
def test_a_device_torch_cannot_use_is_named(tmp_path, device):
    with pytest.raises(ValueError, match=r"^device: .* is not a device this torch can use"):
        mha.MultiHeadAttention(16, 4, device=device)
    with pytest.raises(ValueError, match=r"^device: .* is not a device this torch can use"):
        TinyDecoder(32, 16, 1, 4, device=device)
    path = tmp_path / "m.safetensors"
    mha.io.save(mha.MultiHeadAttention(16, 4), path)
    with pytest.raises(ValueError, match=r"^device: .* is not a device this torch can use"):
        mha.io.load(path, device=device)
    assert mha.io.load(path, device="cpu").out_proj.weight.device.type == "cpu"
