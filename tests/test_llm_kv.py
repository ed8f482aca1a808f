"""K/V storage of transformers' cache through mha (``MhaCache(kv_dtype=...)``), on a small
Llama config with seeded random weights (nothing is downloaded): bf16 and int8 storage under an
fp32 model; int8 decode steps read the int8 rows in place (``flash_decode`` with the scales,
no dequantized copy); the attention output within the bound derived for int8 K/V (KVCache's
docstring, docs/llm.md); beam reordering moves the scales; refusals leave the cache unchanged.
Also ``MultiHeadAttention.new_cache(kv_dtype="int8")``.

Shape legend: B batch, h/h_kv heads, P prompt length, N new tokens, d head dim, V vocabulary.
"""

from __future__ import annotations

import copy
import math

import pytest

pytest.importorskip("transformers", reason="transformers not installed (pip install 'mha[hf]')")

import torch  # noqa: E402
import transformers as tf  # noqa: E402

import mha  # noqa: E402
import mha.integrations.hf_cache as hc  # noqa: E402
from mha.integrations import transformers as hf_attn  # noqa: E402
from mha.ops import decode  # noqa: E402
from test_cache_int8 import _bound  # noqa: E402
from test_decode import NEEDS_KERNEL  # noqa: E402

CFG = tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                     max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     initializer_range=0.02)
IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [9, 10, 11, 12, 13, 14]])  # (B, P)
N = 8
# storage name -> (what kv_dtype accepts, the layer's storage dtype)
KV = {"model's": (None, torch.float32), "fp32": ("fp32", torch.float32),
      "bf16": ("bf16", torch.bfloat16), "torch.bfloat16": (torch.bfloat16, torch.bfloat16),
      "int8": ("int8", torch.int8), "torch.int8": (torch.int8, torch.int8)}


@pytest.fixture(scope="module")
def model():
    hc.register()
    torch.manual_seed(0)
    m = tf.LlamaForCausalLM(copy.deepcopy(CFG))
    m.set_attn_implementation("mha")
    return m.eval()


def _forced(model, kv_dtype, tokens: torch.Tensor, P: int) -> torch.Tensor:
    """Logits ``(B, T - P + 1, V)``: the prompt ``tokens[:, :P]`` then one decode step per
    later token (teacher forcing), through an MhaCache storing ``kv_dtype``."""
    cache = hc.MhaCache(model.config, max_cache_len=tokens.shape[1], kv_dtype=kv_dtype)
    with torch.no_grad():
        rows = [model(input_ids=tokens[:, :P], cache=cache, use_cache=True).logits[:, -1]]
        for t in range(P, tokens.shape[1]):
            rows.append(model(input_ids=tokens[:, t:t + 1], cache=cache,
                              use_cache=True).logits[:, -1])
    return torch.stack(rows, 1)  # (B, T - P + 1, V)


@pytest.mark.parametrize("name", list(KV))
def test_storage_dtype_and_logits_near_the_fp32_cache(model, name):
    """Each storage generates; its layers hold what was asked; teacher-forced logits stay near
    the fp32 cache's (a loose, model-scale tolerance: the exact bound is per attention call,
    tested below) and differ from them when the storage rounds."""
    kv_dtype, stored = KV[name]
    cache = hc.MhaCache(model.config, max_cache_len=IDS.shape[1] + N, kv_dtype=kv_dtype)
    with torch.no_grad():
        seq = model.generate(IDS, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                             pad_token_id=0, cache=cache)  # (B, P + N)
    assert all(layer.kv.k.dtype == stored for layer in cache.layers)
    assert cache.get_seq_length() == IDS.shape[1] + N - 1
    want = _forced(model, None, seq, IDS.shape[1])
    got = _forced(model, kv_dtype, seq, IDS.shape[1])
    diff = (got - want).abs().max().item()
    assert diff <= 0.05 * want.abs().max().item(), diff
    assert (diff == 0) == (stored == torch.float32)


@NEEDS_KERNEL
def test_int8_decode_reads_the_int8_rows_in_place(model, monkeypatch):
    """Decode steps (and a prompt of at most 16 tokens) call flash_decode with the int8
    storage and its scales, and never dequantize (KVCache.keys is not called)."""
    deq, kernel = [], []
    real_keys, real_decode = mha.KVCache.keys, decode.flash_decode

    def keys(self):
        deq.append(self.max_length)
        return real_keys(self)

    def flash_decode(q, k, v, **kw):
        kernel.append((q.shape[2], k.dtype, kw.get("k_scale") is not None))
        return real_decode(q, k, v, **kw)

    monkeypatch.setattr(mha.KVCache, "keys", keys)
    monkeypatch.setattr(decode, "flash_decode", flash_decode)
    cache = hc.MhaCache(model.config, max_cache_len=IDS.shape[1] + N, kv_dtype="int8")
    with torch.no_grad():
        model.generate(IDS, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                       pad_token_id=0, cache=cache)
    layers, P = CFG.num_hidden_layers, IDS.shape[1]  # P = 6 <= 16: the prompt too
    assert deq == []
    assert kernel == [(P, torch.int8, True)] * layers + [(1, torch.int8, True)] * (
        layers * (N - 1))


@NEEDS_KERNEL
@pytest.mark.parametrize("Tq", [1, 3, 20])
@pytest.mark.parametrize("group", [1, 3])
def test_int8_attention_is_within_the_derived_bound(Tq, group):
    """The "mha" attention function on an int8 MhaCache layer's views against the same call on
    an fp32 layer (random K/V, GQA): within the bound of docs/llm.md plus each side's float32
    rounding (measured against float64 on the K/V each side reads). Tq = 20 is the prompt
    path (the attended positions dequantized)."""
    g = torch.Generator().manual_seed(Tq * group)
    B, h_kv, Tk, d = 2, 2, 300, 64
    h = h_kv * group
    k = torch.randn(B, h_kv, Tk, d, generator=g) * (1 + 3 * torch.rand(B, h_kv, Tk, 1,
                                                                         generator=g))
    v = torch.randn(B, h_kv, Tk, d, generator=g)
    q = torch.randn(B, h, Tq, d, generator=g) * 2  # (B, h, Tq, d)
    outs = {}
    for kv_dtype in (None, "int8"):
        cache = hc.MhaCache(num_layers=1, max_cache_len=Tk, kv_dtype=kv_dtype)
        with torch.no_grad():
            kk, vv = cache.update(k, v, 0)  # (B, h_kv, Tk, d) views of the storage
            mask = hf_attn.mask_for_mha(B, Tq, Tk, q_offset=Tk - Tq)  # causal, bottom-right
            outs[kv_dtype], _ = hf_attn.attention_forward(
                torch.nn.Module(), q, kk, vv, mask)  # (B, Tq, h, d)
        outs[kv_dtype, "kv"] = cache.layers[0].kv
    full, int8 = outs[None, "kv"], outs["int8", "kv"]
    got, want = outs["int8"].transpose(1, 2).double(), outs[None].transpose(1, 2).double()
    allowed = mha.causal_mask(Tq, Tk) if Tq > 1 else None
    ref8 = mha.reference.attention(q, int8.keys(), int8.values(), allowed=allowed,
                                   upcast=True)[0]
    ref = mha.reference.attention(q, full.keys(), full.values(), allowed=allowed,
                                  upcast=True)[0]
    bound = _bound(q, full, 1 / math.sqrt(d))  # (B, h, Tq, d)
    slack = (got - ref8).abs() + (want - ref).abs()
    assert ((got - want).abs() <= bound + slack).all()
    assert (got - want).abs().max() > 0


def test_reorder_moves_the_int8_scales(model):
    """Beam search's reorder_cache on an int8 cache: the rows (int8 K/V and their scales) swap,
    so the next step's logits are the other row's."""
    with torch.no_grad():
        logits = {}
        for swap in (False, True):
            cache = hc.MhaCache(model.config, max_cache_len=IDS.shape[1] + 1, kv_dtype="int8")
            model(input_ids=IDS, cache=cache, use_cache=True)
            tok = torch.tensor([[3], [4]])  # (B, 1)
            if swap:
                cache.reorder_cache(torch.tensor([1, 0]))
                tok = tok.flip(0)
            logits[swap] = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(logits[True], logits[False].flip(0), rtol=0, atol=0)


def _state(cache):
    return [tuple(t.clone() for t in (layer.kv.lengths, layer.kv.k, layer.kv.v,
                                      layer.kv.k_scale, layer.kv.v_scale))
            for layer in cache.layers]


def test_full_int8_cache_refuses_and_is_unchanged(model):
    cache = hc.MhaCache(model.config, max_cache_len=IDS.shape[1] + 1, kv_dtype="int8")
    with torch.no_grad():
        model(input_ids=IDS, cache=cache, use_cache=True)
        model(input_ids=IDS[:, :1], cache=cache, use_cache=True)
        before = _state(cache)
        with pytest.raises(ValueError, match="MhaCache is full.*max_cache_len=7"):
            model(input_ids=IDS[:, :1], cache=cache, use_cache=True)
    after = _state(cache)
    assert all(torch.equal(x, y) for a, b in zip(before, after, strict=True)
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(kv_dtype="int4"), ValueError, "kv_dtype must be None .* fp32, bf16, fp16, int8"),
    (dict(kv_dtype=torch.float64), ValueError, "kv_dtype"),
    (dict(kv_dtype=8), ValueError, "got 8"),
])
def test_bad_kv_dtype(model, kwargs, err, match):
    with pytest.raises(err, match=match):
        hc.MhaCache(model.config, max_cache_len=8, **kwargs)


def test_int8_needs_mha_attention():
    cfg = copy.deepcopy(CFG)
    cfg._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="kv_dtype='int8' needs attn_implementation='mha'"):
        hc.MhaCache(cfg, max_cache_len=8, kv_dtype="int8")
    hc.MhaCache(cfg, max_cache_len=8, kv_dtype="bf16")  # a float storage works with any


def test_int8_views_without_their_cache_are_refused():
    q = torch.randn(1, 2, 1, 16)
    k = torch.zeros(1, 1, 4, 16, dtype=torch.int8)
    with pytest.raises(TypeError, match="scales are unknown"):
        hf_attn.attention_forward(torch.nn.Module(), q, k, k, None)


@NEEDS_KERNEL
def test_module_new_cache_int8_decodes_in_place(monkeypatch):
    """``new_cache(kv_dtype="int8")``: the module's cached steps run the int8 decode kernel
    (no dequantized copy) and stay within int8's error of the fp32 cache."""
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(64, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 12, 64)  # (B, T, d_model)
    full, int8 = m.new_cache(2, 16), m.new_cache(2, 16, kv_dtype="int8")
    assert int8.kv_dtype == "int8" and int8.k.dtype == torch.int8
    with torch.no_grad():
        m(x[:, :8], cache=full, causal=True)
        m(x[:, :8], cache=int8, causal=True)
        calls = []
        real = mha.KVCache.keys
        monkeypatch.setattr(mha.KVCache, "keys",
                            lambda self: calls.append(self.kv_dtype) or real(self))
        for t in range(8, 12):
            a = m(x[:, t:t + 1], cache=full)  # (B, 1, d_model)
            b = m(x[:, t:t + 1], cache=int8)
            assert 0 < (a - b).abs().max() < 0.02
    assert "int8" not in calls and int8.max_length == 12
    with pytest.raises(ValueError, match="kv_dtype"):
        m.new_cache(1, 4, kv_dtype="int4")
