"""Decoding through ``attn_implementation="mha"`` in real transformers architectures: greedy
``generate`` with transformers' own KV caches (dynamic and static), batched prompts with left
padding, GQA (Llama, Qwen2 with h_kv < h) and sliding windows (Qwen2), against ``"eager"``.

Models are small configs with seeded random weights (nothing is downloaded). A wide
``initializer_range`` keeps the random logits far from ties, so greedy tokens are stable.
Shape legend: B batch, h/h_kv heads, Tq/Tk lengths, d head dim.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers", reason="transformers not installed (pip install 'mha[hf]')")

import torch  # noqa: E402
import transformers as tf  # noqa: E402

import mha.integrations.transformers as hf  # noqa: E402

PROMPTS = torch.tensor([[0, 0, 5, 6, 7, 8],   # left padded (pad id 0)
                        [9, 10, 11, 12, 13, 14],
                        [0, 0, 0, 0, 3, 4]])
NEW = 8


def gpt2(**kw):
    return tf.GPT2LMHeadModel, tf.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, initializer_range=0.2, **kw)


def llama(**kw):
    return tf.LlamaForCausalLM, tf.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=101, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, initializer_range=0.2, **kw)


def qwen2_sliding():
    return tf.Qwen2ForCausalLM, tf.Qwen2Config(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=101, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, initializer_range=0.2, use_sliding_window=True,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"])


def pair(arch):
    """The same seeded weights under "eager" and under "mha"."""
    hf.register()
    cls, cfg = arch
    torch.manual_seed(0)
    weights = cls(copy.deepcopy(cfg)).state_dict()
    out = {}
    for impl in ("eager", "mha"):
        m = cls(copy.deepcopy(cfg))  # a model shares its config object: one copy each
        m.load_state_dict(weights)
        m.set_attn_implementation(impl)
        out[impl] = m.eval()
    assert out["eager"].config._attn_implementation == "eager"
    assert out["mha"].config._attn_implementation == "mha"
    return out


def generate(model, **kw):
    with torch.no_grad():
        return model.generate(input_ids=PROMPTS, attention_mask=(PROMPTS != 0).long(),
                              max_new_tokens=NEW, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, **kw)


def assert_same_generation(models, **kw):
    want = generate(models["eager"], **kw)
    got = generate(models["mha"], **kw)
    assert got.sequences.shape == (3, PROMPTS.shape[1] + NEW)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits) == NEW
    for step, (g, w) in enumerate(zip(got.logits, want.logits, strict=True)):
        err = (g - w).abs().max().item()
        assert err < 1e-4, f"step {step}: max |logit mha - eager| = {err}"
    # the random model is not degenerate: it emits several different tokens
    assert got.sequences[:, PROMPTS.shape[1]:].unique().numel() > 3
    return got


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_gpt2_greedy_left_padded(spy, cache):
    models = pair(gpt2(scale_attn_by_inverse_layer_idx=True))
    kw = {} if cache == "dynamic" else {"cache_implementation": "static"}
    assert_same_generation(models, **kw)
    prefill, step = spy[0], spy[-1]
    assert prefill["q"] == (3, 4, 6, 16)
    assert step["q"][2] == 1 and step["k"][2] >= PROMPTS.shape[1] + NEW - 1  # cache is read
    # scale_attn_by_inverse_layer_idx: layer 1 scales by 1/(sqrt(d) * 2)
    assert {round(c["scale"], 6) for c in spy} == {round(16 ** -0.5, 6), round(16 ** -0.5 / 2, 6)}
    if cache == "dynamic":  # causal stays a flag; left padding is a (B, 1, 1, Tk) key mask
        assert prefill["causal"] and prefill["mask"].shape == (3, 1, 1, 6)


def test_llama_gqa_greedy(spy):
    assert_same_generation(pair(llama()))
    assert spy[0]["q"] == (3, 4, 6, 16) and spy[0]["k"] == (3, 2, 6, 16)  # K/V not repeated


def test_qwen2_sliding_window_greedy(spy):
    assert_same_generation(pair(qwen2_sliding()))
    assert spy[0]["k"][1] == 1  # multi-query
    # the sliding layer gets the window as a mask built by transformers' mask functions
    sliding = spy[0]["mask"]
    assert sliding is not None and sliding.shape[-2:] == (6, 6) and not spy[0]["causal"]


def test_gpt2_attentions_match_eager():
    models = pair(gpt2())
    am = (PROMPTS != 0).long()
    with torch.no_grad():
        got = models["mha"](input_ids=PROMPTS, attention_mask=am, output_attentions=True)
        want = models["eager"](input_ids=PROMPTS, attention_mask=am, output_attentions=True)
    torch.testing.assert_close(got.logits[am.bool()], want.logits[am.bool()])
    real = am.bool()[:, None, :, None]  # (B, 1, Tq, 1): query rows of real tokens
    for g, w in zip(got.attentions, want.attentions, strict=True):
        assert g is not None and g.shape == w.shape == (3, 4, 6, 6)
        # rows of padding queries see no key: mha gives zeros, eager a uniform row
        torch.testing.assert_close(g * real, w * real)


def test_eager_side_does_not_call_mha(spy):
    models = pair(gpt2())
    generate(models["eager"])
    assert spy == []
    generate(models["mha"])
    assert len(spy) == 2 * NEW  # 2 layers x (prefill + NEW - 1 decode steps)
