"""Score variants through ``attn_implementation="mha"``: Gemma 2 (soft-capping, alternating
sliding windows), Gemma 3, gpt-oss (attention sinks, sliding windows, a tiny MoE), T5 and mT5
(learned relative position bias in the encoder, the decoder and cross-attention), against
``"eager"``.

Tolerance (tests/oracle.py's rule applied to a whole model): mha's logits (and gradients) in
float32 differ from eager's in float64 by at most twice what eager's own float32 run differs,
plus the float32 floor. Greedy tokens are identical. Models are small configs with seeded
random weights (nothing is downloaded); a wide ``initializer_range`` keeps greedy choices far
from ties. Shape legend: B batch, h heads, Tq/Tk lengths, d head dim.
"""

from __future__ import annotations

import copy
import sys

import pytest

pytest.importorskip("transformers", reason="transformers not installed (pip install 'mha[hf]')")

import torch  # noqa: E402
import transformers as tf  # noqa: E402

import mha  # noqa: E402
import mha.integrations.transformers as hf  # noqa: E402

from oracle import FLOOR, max_err  # noqa: E402

PROMPTS = torch.tensor([[0, 0, 5, 6, 7, 8, 9],   # left padded (pad id 0)
                        [9, 10, 11, 12, 13, 14, 15],
                        [0, 0, 0, 0, 3, 4, 5]])
NEW = 4
SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2,
             sliding_window=3, layer_types=["sliding_attention", "full_attention"],
             tie_word_embeddings=False)


def gemma2():
    return tf.Gemma2ForCausalLM, tf.Gemma2Config(
        **SMALL, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
        final_logit_softcapping=30.0)


def gemma3():
    return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(**SMALL, query_pre_attn_scalar=16)


def gpt_oss():
    return tf.GptOssForCausalLM, tf.GptOssConfig(**SMALL, num_local_experts=4,
                                                  num_experts_per_tok=2)


def t5(cls=tf.T5ForConditionalGeneration, config=tf.T5Config, init=4.0):
    return cls, config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                       num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                       relative_attention_max_distance=16, dropout_rate=0.0,
                       initializer_factor=init, pad_token_id=0, eos_token_id=2,
                       decoder_start_token_id=0, tie_word_embeddings=False)


ORACLE = "mha_tests_eager_fp64"


def eager_fp64(module, query, key, value, attention_mask, **kwargs):
    """The model's own eager attention, in float64. Gemma's eager computes its softmax in
    float32 (``dtype=torch.float32``), where float64's ``finfo.min`` mask becomes -inf and a
    padding query's row NaN; the mask is clamped to float32's range first, nothing else."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.clamp_min(torch.finfo(torch.float32).min)
    return eager(module, query, key, value, attention_mask, **kwargs)


def trio(arch, *, sinks_std: float | None = None):
    """The same seeded weights under eager in float64 (the oracle), eager in float32 (the
    yardstick) and mha in float32."""
    hf.register()
    tf.AttentionInterface.register(ORACLE, eager_fp64)
    tf.masking_utils.AttentionMaskInterface.register(
        ORACLE, tf.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    cls, cfg = arch
    torch.manual_seed(0)
    model = cls(copy.deepcopy(cfg))
    if sinks_std is not None:  # sinks large enough to matter (the init draws them tiny)
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.data.normal_(0.0, sinks_std)
    weights = model.state_dict()
    out = {}
    for impl, attn, dtype in (("oracle", ORACLE, torch.float64),
                              ("eager", "eager", torch.float32), ("mha", "mha", torch.float32)):
        m = cls(copy.deepcopy(cfg))  # a model shares its config object: one copy each
        m.load_state_dict(weights)
        m.set_attn_implementation(attn)
        if hasattr(m.config, "num_local_experts"):  # the grouped MoE GEMM has no float64
            m.set_experts_implementation("eager")
        out[impl] = m.to(dtype).eval()
    assert out["mha"].config._attn_implementation == "mha"
    return out


def assert_rule(got, yardstick, oracle, what):
    budget = 2 * max_err(yardstick, oracle) + FLOOR[torch.float32]
    err = max_err(got, oracle)
    assert err <= budget, f"{what}: mha error {err:.3e} > budget {budget:.3e} (2x eager fp32)"


def greedy(model, **kw):
    with torch.no_grad():
        return model.generate(do_sample=False, max_new_tokens=NEW, output_logits=True,
                              return_dict_in_generate=True, **kw)


def assert_same_generation(models, **kw):
    runs = {impl: greedy(m, **kw) for impl, m in models.items()}
    assert torch.equal(runs["mha"].sequences, runs["eager"].sequences)
    assert torch.equal(runs["mha"].sequences, runs["oracle"].sequences)
    for step in range(NEW):
        assert_rule(runs["mha"].logits[step], runs["eager"].logits[step],
                    runs["oracle"].logits[step], f"logits of step {step}")
    new = runs["mha"].sequences[:, -NEW:]
    assert new.unique().numel() > 2  # the random model is not degenerate


@pytest.fixture
def calls(monkeypatch):
    """The variant arguments each mha.attention call received."""
    seen = []
    inner = hf.attention

    def spy(q, k, v, **kw):
        seen.append({n: kw.get(n) for n in ("softcap", "sinks", "bias", "mask", "causal")})
        return inner(q, k, v, **kw)

    monkeypatch.setattr(hf, "attention", spy)
    return seen


def decoder_generation(arch, **kw):
    models = trio(arch, **kw)
    assert_same_generation(models, input_ids=PROMPTS, attention_mask=(PROMPTS != 0).long())


def test_gemma2_softcap_and_sliding_window(calls):
    decoder_generation(gemma2())
    assert calls[0]["softcap"] == 2.0 and calls[0]["bias"] is None
    sliding, full = calls[0]["mask"], calls[1]
    assert sliding is not None and sliding.shape[-2:] == (7, 7)  # the window travels as a mask
    assert full["causal"]


def test_gemma3_sliding_window(calls):
    decoder_generation(gemma3())
    assert calls[0]["softcap"] is None and calls[0]["mask"].shape[-2:] == (7, 7)


def test_gpt_oss_sinks_and_sliding_window(calls):
    decoder_generation(gpt_oss(), sinks_std=2.0)
    assert calls[0]["sinks"].shape == (4,) and calls[0]["mask"].shape[-2:] == (7, 7)


SRC = torch.tensor([[5, 6, 7, 8, 9, 10, 2],
                    [11, 12, 13, 2, 0, 0, 0]])  # right padded (pad id 0)
TGT = torch.tensor([[0, 20, 21, 22, 23],
                    [0, 30, 31, 32, 0]])


@pytest.mark.parametrize("arch", [t5(), t5(tf.MT5ForConditionalGeneration, tf.MT5Config)],
                         ids=["t5", "mt5"])
def test_t5_family_position_bias(calls, arch):
    models = trio(arch)
    am = (SRC != 0).long()
    with torch.no_grad():
        logits = {impl: m(input_ids=SRC, attention_mask=am, decoder_input_ids=TGT).logits
                  for impl, m in models.items()}
    assert_rule(logits["mha"], logits["eager"], logits["oracle"], "logits")
    biased = [c["bias"] for c in calls if c["bias"] is not None]
    # encoder (bidirectional buckets) and decoder self-attention (causal buckets) per layer;
    # cross-attention's all-zero bias is dropped
    assert len(biased) == 4 and biased[0].shape == (1, 4, 7, 7)
    assert biased[2].shape == (1, 4, 5, 5)
    assert_same_generation(models, input_ids=SRC, attention_mask=am)


def test_t5_training_step_gradients():
    """One SGD step: the loss's gradients through mha (relative bias table included) equal
    eager's within the rule.

    T5 does not scale its scores; with initializer_factor 4 the random weights push them to
    +-400, where a backward that recomputes P from the log-sum-exp (every flash kernel, SDPA's
    included) carries the forward's fp32 rounding of S (~1e-4 absolute at 400) into each P of a
    saturated row, while eager reuses its stored P. The default factor 1 keeps the scores in
    the tens, as in trained T5 models (docs/kernel.md, "Accuracy of the backward")."""
    models = trio(t5(init=1.0))
    am, labels = (SRC != 0).long(), TGT[:, 1:].masked_fill(TGT[:, 1:] == 0, -100)
    grads = {}
    for impl, m in models.items():
        m.train()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt.zero_grad()
        m(input_ids=SRC, attention_mask=am, labels=labels).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        opt.step()
    names = set(grads["oracle"])
    assert set(grads["mha"]) == names
    assert any("relative_attention_bias" in n for n in names)
    for n in sorted(names):
        assert_rule(grads["mha"][n], grads["eager"][n], grads["oracle"][n], f"grad of {n}")


# ------------------------------------------------------------------ the adapter alone
class _Layer(torch.nn.Module):
    is_causal = False


def _qkv(B=2, h=4, h_kv=2, Tq=5, Tk=6, d=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, h, Tq, d, generator=g), torch.randn(B, h_kv, Tk, d, generator=g),
            torch.randn(B, h_kv, Tk, d, generator=g))


def _eager(q, k, v, add, *, head_mask=None):
    """transformers 4's eager attention: softmax(q k^T * scale + add) * head_mask @ v."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (B, h, Tk, d)
    w = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + add, -1)  # (B, h, Tq, Tk)
    if head_mask is not None:
        w = w * head_mask
    return (w @ v).transpose(1, 2), w  # (B, Tq, h, d)


@pytest.mark.parametrize("shape", [(4,), (1, 4, 1, 1), (2, 4, 5, 1)])
def test_head_mask_scales_each_head(shape):
    q, k, v = _qkv()
    hm = torch.rand(shape, generator=torch.Generator().manual_seed(1))
    hm.view(-1)[0] = 0.0  # one head (row) switched off
    want, want_w = _eager(q, k, v, 0.0, head_mask=hm.view(1, 4, 1, 1) if len(shape) == 1 else hm)
    out, w = hf.attention_forward(_Layer(), q, k, v, None, head_mask=hm, output_attentions=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(w, want_w)


@pytest.mark.parametrize("head_mask,err", [
    (torch.ones(3), ValueError), (torch.ones(1, 4, 5, 6), ValueError),
    (torch.ones(4, dtype=torch.long), TypeError)])
def test_head_mask_refusals_name_it(head_mask, err):
    q, k, v = _qkv()
    with pytest.raises(err, match="head_mask"):
        hf.attention_forward(_Layer(), q, k, v, None, head_mask=head_mask)


def test_float_mask_with_a_real_bias_is_added():
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(2)
    add = torch.randn(2, 1, 5, 6, generator=g)  # a real bias ...
    add[0, 0, :, 4:] = torch.finfo(torch.float32).min  # ... and masked pairs
    add[1, 0, 2, :3] = float("-inf")
    want, _ = _eager(q, k, v, add)
    out, _ = hf.attention_forward(_Layer(), q, k, v, add)
    torch.testing.assert_close(out, want)


def test_position_bias_and_float_mask_bias_add_up():
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(3)
    pb = torch.randn(1, 4, 5, 6, generator=g)
    add = torch.randn(2, 1, 5, 6, generator=g)
    want, _ = _eager(q, k, v, pb + add)
    out, _ = hf.attention_forward(_Layer(), q, k, v, add, position_bias=pb)
    torch.testing.assert_close(out, want)


def test_packed_sequences_refuse_variants():
    q, k, v = _qkv(B=1, Tq=6)
    with pytest.raises(NotImplementedError, match="softcap"):
        hf.attention_forward(_Layer(), q, k, v, None, softcap=5.0,
                             cu_seq_lens_q=torch.tensor([0, 2, 6]))


@pytest.mark.parametrize("kwargs,match", [
    (dict(cache=object()), "paged"),
    (dict(indices=torch.zeros(2, 5, 3, dtype=torch.int32)), "indices"),
    (dict(block_indices=torch.zeros(2, 5, 3, dtype=torch.int32)), "block_indices")])
def test_what_mha_lacks_raises_naming_it(kwargs, match):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=match):
        hf.attention_forward(_Layer(), q, k, v, None, **kwargs)


def test_float_mask_row_with_no_pair_above_half_finfo_min_follows_eager():
    """A row of a float mask whose finite values are all about ``finfo.min`` is not masked in
    eager or SDPA: the scores vanish in the sum, so the row's weights are the softmax of the
    mask alone (uniform over its ``finfo.min`` entries, nothing at its -inf ones). mha gives
    that row the same output and weights, so a later layer reading it at that position sees
    what transformers computes; a row of -inf only stays the row that attends nothing."""
    q, k, v = _qkv(d=16)  # d_k 16: the native kernels serve it
    lo = torch.finfo(torch.float32).min
    add = torch.zeros(2, 1, 5, 6)
    add[0, 0, 1, :] = lo  # every pair at finfo.min: uniform
    add[1, 0, 3, :] = lo
    add[1, 0, 3, 4] = float("-inf")  # ... over the finite entries only
    add[0, 0, 2, :3] = lo  # a row that keeps pairs: the masked ones are masked
    want, want_w = _eager(q, k, v, add)
    out, w = hf.attention_forward(_Layer(), q, k, v, add, output_attentions=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(w, want_w)
    for backend in ("flash_cpu", "sdpa", "math"):  # without weights: each backend's rows
        with mha.use_backend(backend):
            out_b, _ = hf.attention_forward(_Layer(), q, k, v, add)
        torch.testing.assert_close(out_b, want, msg=lambda m, b=backend: f"{b}: {m}")
    torch.testing.assert_close(w[0, :, 1], torch.full((4, 6), 1 / 6))
    add[0, 0, 1, :] = float("-inf")  # nothing finite: the row attends nothing
    out, w = hf.attention_forward(_Layer(), q, k, v, add, output_attentions=True)
    assert out[0, 1].abs().max() == 0 and w[0, :, 1].abs().max() == 0


def test_nan_in_a_float_mask_propagates_like_sdpa():
    """A NaN in an additive mask makes its row NaN in eager and SDPA (the NaN is added to a
    score), and in mha's path too: the NaN is not taken for a masked pair (NaN > finfo.min / 2
    is False), which would drop it and give a finite row."""
    q, k, v = _qkv(d=16)
    add = torch.zeros(2, 1, 5, 6)
    add[1, 0, 3, 2] = float("nan")
    want, _ = _eager(q, k, v, add)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=add,
                                                            enable_gqa=True)
    assert want[1, 3].isnan().all() and sdpa[1, :, 3].isnan().all()  # (B, Tq, h, d), (B, h, Tq, d)
    for backend in (None, "flash_cpu", "sdpa", "math"):
        if backend is None:
            out, _ = hf.attention_forward(_Layer(), q, k, v, add)
        else:
            with mha.use_backend(backend):
                out, _ = hf.attention_forward(_Layer(), q, k, v, add)
        assert out[1, 3].isnan().all(), backend
        torch.testing.assert_close(out[~want.isnan()], want[~want.isnan()])
