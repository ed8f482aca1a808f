"""RoPE angles once per forward: :class:`mha.models.Llama` computes the ``(C, S)`` of its tokens'
positions once (:meth:`Llama.rope_angles`) and hands them to every layer's attention
(``MultiHeadAttention(..., angles=...)``), instead of each layer computing the same ones from its
own cache. The logits are compared **bitwise** (``torch.equal``) with the per-layer computation
(the same model with ``rope_angles`` made to return None, so that each layer takes its positions
as before) for prefill, decode steps, left-padded batches (attention mask and caches' left
padding), paged steps, fp32 and float64; and the module alone gives bitwise the same output for
``positions=p`` and ``angles=rope.angles(p, ...)``, and refuses bad angles with its state
unchanged (tests/tiny_llama.py's config; nothing downloaded).

Shape legend: B batch, P prompt tokens, N packed tokens, V vocabulary, r rotated dims.
"""

from __future__ import annotations

import copy

import pytest

transformers = pytest.importorskip("transformers", reason="transformers not installed "
                                   "(pip install 'mha[hf]')")

import torch  # noqa: E402

import mha  # noqa: E402
from mha.models.llama import Llama  # noqa: E402
from mha.ops import decode  # noqa: E402
from mha.paged import PagedKVCache  # noqa: E402
from mha.rope import Rotary  # noqa: E402
from tiny_llama import CFG  # noqa: E402


def _llama(dtype=torch.float32) -> Llama:
    torch.manual_seed(0)
    return Llama.from_hf(transformers.LlamaForCausalLM(copy.deepcopy(CFG)).eval()).to(dtype)


def _per_layer(m: Llama) -> Llama:
    """A copy of ``m`` whose layers compute their own angles (the per-layer computation)."""
    ref = copy.deepcopy(m)
    ref.rope_angles = lambda *a: None
    return ref


def _ids(B=3, P=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, CFG.vocab_size, (B, P), generator=g)  # (B, P)


@pytest.fixture
def counted(monkeypatch):
    """The calls of Rotary.angles, counted."""
    calls = []
    real = Rotary.angles
    monkeypatch.setattr(Rotary, "angles", lambda self, *a, **k: calls.append(1) or
                        real(self, *a, **k))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prefill_and_decode_equal_the_per_layer_angles(dtype, counted):
    m = _llama(dtype)
    ref = _per_layer(m)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(m(ids), ref(ids))  # no cache: positions 0 .. P-1
        caches, ref_caches = m.new_caches(3, 16), ref.new_caches(3, 16)
        counted.clear()
        got = [m(ids[:, :5], caches)]  # prefill 5, then one token at a time
        got += [m(ids[:, t:t + 1], caches) for t in range(5, 9)]
        assert len(counted) == 5  # once per forward, not once per layer
        counted.clear()
        want = [ref(ids[:, :5], ref_caches)]
        want += [ref(ids[:, t:t + 1], ref_caches) for t in range(5, 9)]
        assert len(counted) == 5 * CFG.num_hidden_layers
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_layer_with_its_own_rope_turns_by_it(counted):
    """One layer's rope swapped for another (a different theta): the shared angles would be
    layer 0's; each layer turns by its own instead, as the per-layer computation does."""
    m = _llama()
    m.layers[1].self_attn.rope = Rotary(m.layers[1].self_attn.rope.dim, theta=500.0)
    ref = _per_layer(m)
    ids = _ids()
    with torch.no_grad():
        counted.clear()
        got = m(ids)
        assert len(counted) == CFG.num_hidden_layers  # per layer: no shared angles
        assert torch.equal(got, ref(ids))


def test_left_padded_batches_equal_the_per_layer_angles():
    """Rows with 3 and 1 padding tokens: one pass with ``attention_mask`` (positions (B, P)),
    and caches with declared left padding (positions from the caches), then steps."""
    m = _llama()
    ref = _per_layer(m)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)  # (B, P)
    with torch.no_grad():
        assert torch.equal(m(ids, attention_mask=mask), ref(ids, attention_mask=mask))
        outs = []
        for model in (m, ref):
            caches = model.new_caches(3, 16)
            for c in caches:
                c.mark_left_padding(torch.tensor([0, 3, 1]))
            steps = [model(ids, caches)]
            token = steps[0][:, -1:].argmax(-1)  # (B, 1)
            for _ in range(3):
                steps.append(model(token, caches))
                token = steps[-1][:, -1:].argmax(-1)
            outs.append(steps)
    for g, w in zip(*outs, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(m.generate(ids, 4, attention_mask=mask),
                       ref.generate(ids, 4, attention_mask=mask))


@pytest.mark.skipif(decode.unavailable() is not None,
                    reason=f"decode kernel unavailable: {decode.unavailable()}")
def test_paged_steps_equal_the_per_layer_angles(counted):
    """A prefill of three sequences, then mixed steps (a prefill chunk beside decode rows)."""
    m = _llama()
    ref = _per_layer(m)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, CFG.vocab_size, (3, 30), generator=g).tolist()
    steps = [[(0, 7), (1, 3), (2, 1)], [(0, 1), (1, 1), (2, 5)], [(2, 1), (0, 1), (1, 4)],
             [(0, 1), (1, 1), (2, 1)]]
    outs = []
    for model in (m, ref):
        cache = PagedKVCache(32, 4, CFG.num_key_value_heads, model.settings.head_dim,
                             max_seqs=3, max_len=30, num_layers=CFG.num_hidden_layers)
        slot = [cache.add_sequence() for _ in range(3)]
        done = [0, 0, 0]
        logits = []
        counted.clear()
        for step in steps:
            ids, pos, cu = [], [], [0]
            for s, n in step:
                ids += tokens[s][done[s]:done[s] + n]
                pos += range(done[s], done[s] + n)
                cu.append(cu[-1] + n)
                done[s] += n
            cache.extend([slot[s] for s, _ in step], [n for _, n in step])
            logits.append(model.forward_paged(torch.tensor([ids]), torch.tensor(pos), cache,
                                              [slot[s] for s, _ in step], cu))  # (1, N, V)
        outs.append(logits)
        assert len(counted) == len(steps) * (1 if model is m else CFG.num_hidden_layers)
    for got, want in zip(*outs, strict=True):
        assert torch.equal(got, want)


# ------------------------------------------------------------------ the module alone
def _module(dtype=torch.float32):
    torch.manual_seed(0)
    return mha.MultiHeadAttention(64, 4, num_kv_heads=2, rope=Rotary(16, theta=500.0),
                                  bias=False).eval().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_module_given_angles_equals_positions(dtype):
    m = _module(dtype)
    x = torch.randn(2, 5, 64, dtype=dtype)
    p = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])  # (B, T)
    with torch.no_grad():
        angles = m.rope.angles(p, 2, 5, x.device, x.dtype)  # (B, T, r) x 2
        assert torch.equal(m(x, positions=p, causal=True), m(x, angles=angles, causal=True))
        c1, c2 = m.new_cache(2, 12), m.new_cache(2, 12)
        c1.mark_left_padding(torch.tensor([0, 2]))
        c2.mark_left_padding(torch.tensor([0, 2]))
        for t in range(3):
            step = x[:, t:t + 2]  # (B, 2, d_model)
            at = m.rope.angles(c2.positions(2), 2, 2, x.device, x.dtype)  # (B, 2, r) x 2
            assert torch.equal(m(step, cache=c1), m(step, cache=c2, angles=at))


@pytest.mark.parametrize("angles, kw, err, match", [
    (lambda m: m.rope.angles(None, 2, 5, "cpu"), dict(positions=torch.arange(5)), ValueError,
     "angles and positions: give one"),
    (lambda m: m.rope.angles(None, 2, 4, "cpu"), {}, ValueError,
     r"angles: C must be \(B\|1, Tq, r\) = \(2 or 1, 5, 16\) torch.float32"),
    (lambda m: m.rope.angles(None, 2, 5, "cpu", torch.float64), {}, ValueError,
     "angles: C must be .* got \\(1, 5, 16\\) torch.float64"),
    (lambda m: m.rope.angles(None, 2, 5, "cpu")[0], {}, TypeError, "angles must be a pair"),
    (lambda m: (m.rope.angles(None, 2, 5, "cpu")[0], None), {}, ValueError,
     "angles: S must be .* got NoneType"),
])
def test_bad_angles_are_refused_and_the_cache_unchanged(angles, kw, err, match):
    m = _module()
    x = torch.randn(2, 5, 64)
    with pytest.raises(err, match=match), torch.no_grad():
        m(x, angles=angles(m), **kw)
    cache = m.new_cache(2, 12)
    if "positions" not in kw:
        with pytest.raises(err, match=match), torch.no_grad():
            m(x, cache=cache, angles=angles(m))
        assert cache.lengths.tolist() == [0, 0]


def test_angles_need_rope():
    m = mha.MultiHeadAttention(64, 4).eval()
    angles = Rotary(16).angles(None, 1, 3, "cpu")
    with pytest.raises(ValueError, match="angles: this module has no rope"):
        m(torch.randn(1, 3, 64), angles=angles)


def test_q_and_k_of_one_gemm_rotate_in_one_call_as_in_two(monkeypatch):
    """Q's and K's columns of the QKV GEMM's output are rotated in one call on the h + h_kv
    heads, bitwise as two calls (taken when they are separate tensors)."""
    m = _module()
    qkv = torch.randn(2, 5, 4 * 16 + 2 * 2 * 16)  # (B, T, h*d + 2*h_kv*d)
    q, k, _ = qkv.split((64, 32, 32), dim=-1)
    angles = m.rope.angles(torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]]), 2, 5,
                           torch.device("cpu"))  # (B, T, r) x 2
    calls = []
    real = Rotary.rotate_tokens
    monkeypatch.setattr(Rotary, "rotate_tokens", lambda self, x, *a: calls.append(x.shape) or
                        real(self, x, *a))
    joint = m._rotate_qk(q, k, angles)
    assert calls == [(2, 5, 6, 16)]
    calls.clear()
    apart = m._rotate_qk(q.clone(), k.clone(), angles)
    assert calls == [(2, 5, 4, 16), (2, 5, 2, 16)]
    for a, b in zip(joint, apart, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_q_and_k_adjacent_in_memory_but_of_two_storages_rotate_apart():
    """Q and K of separate allocations that happen to lie end to end in memory (an allocator
    without chunk headers, as jemalloc's size classes, can place a decode step's separate Q and
    K projections so) are rotated in two calls: one view of Q's storage over both would read
    past it. Equal Q and K/V heads: Q's strides are K's, as the one-call rotation needs."""
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(64, 4, rope=Rotary(16, theta=500.0), bias=False).eval()
    H, H_kv, d = m.num_heads, m.num_kv_heads, m.head_dim
    buf = bytearray(4 * (H + H_kv) * d)  # Q's floats, then K's
    q = torch.frombuffer(buf, dtype=torch.float32, count=H * d)  # one storage ...
    k = torch.frombuffer(memoryview(buf)[4 * H * d:], dtype=torch.float32)  # ... and another
    g = torch.Generator().manual_seed(5)
    q.copy_(torch.randn(H * d, generator=g))
    k.copy_(torch.randn(H_kv * d, generator=g))
    q, k = q.view(1, 1, H * d), k.view(1, 1, H_kv * d)  # (B, T, h*d_k), (B, T, h_kv*d_k)
    assert k.data_ptr() == q.data_ptr() + q.shape[-1] * q.element_size()
    angles = m.rope.angles(torch.tensor([[3]]), 1, 1, torch.device("cpu"))  # (1, 1, r) x 2
    got = m._rotate_qk(q, k, angles)
    want = m._rotate_qk(q.clone(), k.clone(), angles)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
