"""Hostile use of the newer surfaces: :class:`mha.models.Llama` (its config, forward, caches and
greedy generate), the K/V caches' positions after a truncate, :class:`mha.cache.ConcatKVCache`,
:mod:`mha.rope`'s scaling dict and :func:`mha.threads.num_threads`. Each wrong input is refused
at the boundary with an error naming the argument, and whatever it would have changed (the
caches, the thread count) is left as it was.

Shape legend: B batch, T tokens, P prompt tokens, N new tokens, V vocabulary, h_kv K/V heads,
d head dim.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mha.cache import ConcatKVCache, KVCache
from mha.models.llama import Llama, llama_settings
from mha.rope import Rotary
from mha.threads import num_threads

V = 50
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _config(**kw) -> dict:
    return {**BASE, **kw}


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama.from_config(_config()).eval()


def _ids(B=2, T=5, seed=1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))  # (B, T)


def _lengths(caches) -> list:
    return [(c.lengths.tolist(), c.starts.tolist()) for c in caches]


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("field,value,error,words", [
    ("rms_norm_eps", -1.0, ValueError, "config.rms_norm_eps"),
    ("rms_norm_eps", float("nan"), ValueError, "config.rms_norm_eps"),
    ("rms_norm_eps", "x", TypeError, "config.rms_norm_eps"),
    ("max_position_embeddings", -1, ValueError, "config.max_position_embeddings"),
    ("max_position_embeddings", "x", TypeError, "config.max_position_embeddings"),
    ("max_position_embeddings", 2.5, TypeError, "config.max_position_embeddings"),
    ("tie_word_embeddings", "false", TypeError, "config.tie_word_embeddings"),
    ("num_key_value_heads", 0, ValueError, "config.num_key_value_heads"),
    ("head_dim", 0, ValueError, "config.head_dim"),
    ("head_dim", -8, ValueError, "config.head_dim"),
    ("rope_theta", "abc", TypeError, "config.rope_theta"),
    ("rope_theta", -1.0, ValueError, "config.rope_theta"),
    ("rope_scaling", "linear", TypeError, "config.rope_scaling"),
    ("rope_parameters", [1, 2], TypeError, "config.rope_parameters"),
    ("rope_scaling", {"rope_type": ["linear"]}, ValueError, "rope_type"),
    ("eos_token_id", "x", TypeError, "config.eos_token_id"),
    ("eos_token_id", -2, ValueError, "config.eos_token_id"),
])
def test_a_config_field_of_the_wrong_kind_is_refused_by_name(field, value, error, words):
    with pytest.raises(error, match=words.replace(".", r"\.").replace("[", r"\[")):
        llama_settings(_config(**{field: value}))


def test_fewer_heads_than_hidden_dims_are_refused_naming_both_fields():
    with pytest.raises(ValueError, match=r"config\.hidden_size.*num_attention_heads"):
        llama_settings(_config(hidden_size=2, num_attention_heads=4))


@pytest.mark.parametrize("field,value", [("num_key_value_heads", None), ("head_dim", None),
                                          ("eos_token_id", [1, 2]), ("eos_token_id", None),
                                          ("max_position_embeddings", np.int64(64))])
def test_absent_or_default_fields_still_build(field, value):
    s = llama_settings(_config(**{field: value}))
    assert (s.num_kv_heads, s.head_dim) == ((2, 8) if field != "num_key_value_heads" else (4, 8))


# ----------------------------------------------------------------------------- forward
@pytest.mark.parametrize("bad", [[[1, V]], [[1, -1]], [[1, 2**40]]])
def test_ids_outside_the_vocabulary_are_refused_naming_ids(model, bad):
    with pytest.raises(ValueError, match=rf"ids must be token ids of the vocabulary \[0, {V}\)"):
        model(torch.tensor(bad))


def test_ids_outside_the_vocabulary_leave_the_caches_unchanged(model):
    caches = model.new_caches(2, 10)
    with torch.no_grad():
        model(_ids(T=3), caches)
        before = _lengths(caches)
        with pytest.raises(ValueError, match="ids must be token ids"):
            model(torch.tensor([[1, 2], [3, V]]), caches)
    assert _lengths(caches) == before


def test_ids_on_another_device_are_refused(model):
    with pytest.raises(ValueError, match="ids must be on cpu like the model"):
        model(_ids().to("meta"))


def test_a_layer_refusing_mid_forward_leaves_every_cache_unchanged(model):
    """The first layer's cache has room, the second's not: the first's append is undone."""
    caches = [model.layers[0].self_attn.new_cache(2, 10),
              model.layers[1].self_attn.new_cache(2, 4)]
    with torch.no_grad():
        with pytest.raises(ValueError, match="KVCache is full"):
            model(_ids(T=6), caches)
    assert _lengths(caches) == [([0, 0], [0, 0])] * 2


def test_a_layer_refusing_mid_forward_leaves_concat_caches_unchanged(model):
    """ConcatKVCache per layer (grown by concatenation): the second layer's cache holds bf16
    K/V and refuses the fp32 rows, so the first layer's append is undone as well."""
    caches = [ConcatKVCache(), ConcatKVCache()]
    with torch.no_grad():
        model(_ids(T=3), caches)
        caches[1].k, caches[1].v = caches[1].k.bfloat16(), caches[1].v.bfloat16()
        before = [(c.k, c.v) for c in caches]
        with pytest.raises(TypeError, match="k_new must be torch.bfloat16"):
            model(_ids(T=2), caches)
    assert all(c.k is k and c.v is v for c, (k, v) in zip(caches, before, strict=True))


def test_concat_caches_holding_different_tokens_per_layer_are_refused(model):
    """As for KVCache: ConcatKVCaches of different lengths would give the layers different
    positions; refused, nothing appended."""
    caches = [ConcatKVCache(), ConcatKVCache()]
    with torch.no_grad():
        model(_ids(T=3), caches)
        model.layers[0](model.embed_tokens(_ids(T=1)), caches[0])  # layer 0 alone: 4 tokens
        before = [(c.k, c.v) for c in caches]
        with pytest.raises(ValueError, match=r"caches\[1\].*caches\[0\]"):
            model(_ids(T=2), caches)
    assert all(c.k is k and c.v is v for c, (k, v) in zip(caches, before, strict=True))


def test_caches_holding_different_tokens_per_layer_are_refused(model):
    """Layers whose caches disagree on the lengths would place the tokens at different
    positions per layer: a wrong answer, so refused (nothing appended)."""
    caches = model.new_caches(2, 10)
    with torch.no_grad():
        model(_ids(T=3), caches)
        caches[1].truncate(1)
        before = _lengths(caches)
        with pytest.raises(ValueError, match=r"caches\[1\].*caches\[0\]"):
            model(_ids(T=2), caches)
    assert _lengths(caches) == before


# ----------------------------------------------------------------------------- generate
@pytest.mark.parametrize("mask", [torch.full((2, 5), 0.5), torch.full((2, 5), 2),
                                  torch.full((2, 5), -1), torch.full((2, 5), float("nan"))])
def test_an_attention_mask_of_other_values_than_0_and_1_is_refused(model, mask):
    with pytest.raises(ValueError, match="attention_mask must hold 0 .* and 1"):
        model.generate(_ids(), 2, attention_mask=mask)


@pytest.mark.parametrize("mask", [torch.ones(2, 5), torch.ones(2, 5, dtype=torch.bool),
                                  torch.ones(2, 5, dtype=torch.int32)])
def test_an_attention_mask_of_ones_in_any_real_dtype_is_no_padding(model, mask):
    assert torch.equal(model.generate(_ids(), 2, attention_mask=mask), model.generate(_ids(), 2))


@pytest.mark.parametrize("mask,error,words", [
    (np.ones((2, 5)), TypeError, "attention_mask must be a torch.Tensor .* got ndarray"),
    (torch.ones(2, 5, device="meta"), ValueError, "attention_mask must be on cpu"),
    (torch.ones(2, 5, dtype=torch.complex64), TypeError, "attention_mask must be"),
])
def test_an_attention_mask_of_the_wrong_type_or_device_is_refused(model, mask, error, words):
    with pytest.raises(error, match=words):
        model.generate(_ids(), 2, attention_mask=mask)


@pytest.mark.parametrize("pad,error", [(V, ValueError), (-1, ValueError), ("a", TypeError),
                                       (1.0, TypeError)])
def test_a_pad_token_id_outside_the_vocabulary_is_refused(model, pad, error):
    with pytest.raises(error, match="pad_token_id"):
        model.generate(_ids(), 2, eos_token_id=3, pad_token_id=pad)


def test_on_token_must_be_callable(model):
    with pytest.raises(TypeError, match="on_token must be callable"):
        model.generate(_ids(), 2, on_token=5)


def test_generate_refuses_ids_outside_the_vocabulary(model):
    with pytest.raises(ValueError, match="ids must be token ids"):
        model.generate(torch.tensor([[1, -3]]), 2)


def test_max_new_tokens_whose_caches_cannot_be_allocated_is_refused_by_name(model):
    with pytest.raises(ValueError, match=r"max_new_tokens=10+.*caches"):
        model.generate(_ids(), 10**12)


def test_generate_twice_gives_the_same_tokens(model):
    assert torch.equal(model.generate(_ids(), 4), model.generate(_ids(), 4))


# ----------------------------------------------------------------------------- caches
def _padded_cache() -> KVCache:
    c = KVCache(2, 1, 8, 4)
    c.mark_left_padding(torch.tensor([3, 0]))
    with torch.no_grad():
        c.append(torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4))  # (B, h_kv, T, d)
    return c


def test_truncating_into_the_left_padding_keeps_positions_at_or_above_0():
    c = _padded_cache()
    assert c.positions(2).tolist() == [[2, 3], [5, 6]]
    c.truncate(torch.tensor([2, 2]))  # row 0 keeps 2 of its 3 padding slots
    assert c.starts.tolist() == [2, 0]
    assert c.positions(2).tolist() == [[0, 1], [2, 3]]


def test_positions_inside_a_declared_padding_are_0():
    c = KVCache(2, 1, 8, 4)
    c.mark_left_padding(3)
    assert c.positions(5).tolist() == [[0, 0, 0, 0, 1]] * 2


def test_a_truncated_rope_cache_then_decodes_as_a_fresh_row():
    """Row 0 cut to its padding, then fed the tokens of row 1: both rows give the same output."""
    import mha

    torch.manual_seed(0)
    m = mha.MultiHeadAttention(16, 2, rope=True).eval()
    x = torch.randn(1, 4, 16)
    cache = m.new_cache(2, 12)
    cache.mark_left_padding(torch.tensor([3, 0]))
    with torch.no_grad():
        m(torch.randn(2, 5, 16), cache=cache)
        cache.truncate(torch.tensor([2, 0]))
        out = m(x.expand(2, 4, 16), cache=cache)  # (B, T, d_model)
    assert torch.allclose(out[0], out[1], atol=1e-6)


def test_a_refused_truncate_changes_nothing():
    c = _padded_cache()
    with pytest.raises(ValueError, match="truncate"):
        c.truncate(torch.tensor([2, 6]))
    assert (c.lengths.tolist(), c.starts.tolist()) == ([5, 5], [3, 0])


def test_truncate_with_meta_n_is_refused_by_name():
    with pytest.raises(ValueError, match="n is a meta tensor"):
        _padded_cache().truncate(torch.tensor([1, 1], device="meta"))


@pytest.mark.parametrize("k,words", [
    (torch.randn(1, 2, 1, 8), r"k_new must have batch size B=2"),
    (torch.randn(2, 1, 1, 8), r"k_new must have .*h_kv=2"),
    (torch.randn(2, 2, 1, 4), r"k_new must have .*d_k=8"),
    (torch.randn(2, 2, 1, 8, dtype=torch.float64), r"k_new must be torch.float32"),
])
def test_concat_cache_refuses_new_rows_that_do_not_match_by_name(k, words):
    c = ConcatKVCache()
    first = torch.randn(2, 2, 3, 8)  # (B, h_kv, T, d)
    with c.appending(first, first):
        pass
    with pytest.raises(ValueError if "dtype" not in words and "float" not in words
                       else TypeError, match=words):
        with c.appending(k, k):
            pass
    assert c.k is first and c.max_length == 3


def test_concat_cache_refuses_a_query_batch_of_another_size_through_the_module():
    import mha

    m = mha.MultiHeadAttention(16, 2, rope=True).eval()
    c = ConcatKVCache()
    with torch.no_grad():
        m(torch.randn(2, 3, 16), cache=c)
        with pytest.raises(ValueError, match="query must have batch size 2"):
            m(torch.randn(1, 3, 16), cache=c)
    assert c.k.shape == (2, 2, 3, 8)


def test_concat_cache_positions_refuse_a_negative_count():
    with pytest.raises(ValueError, match="Tn must be a non-negative int"):
        ConcatKVCache().positions(-1)


# ----------------------------------------------------------------------------- rope scaling
@pytest.mark.parametrize("scaling", [{"rope_type": ["linear"]}, {"rope_type": {"a": 1}},
                                     {"type": ["linear"], "factor": 2.0}])
def test_an_unhashable_rope_type_is_refused_by_name(scaling):
    with pytest.raises(ValueError, match="scaling: rope_type must be one of"):
        Rotary(8, scaling=scaling)


def test_two_different_rope_type_spellings_are_refused():
    with pytest.raises(ValueError, match="scaling: rope_type 'linear' and type 'llama3'"):
        Rotary(8, scaling={"rope_type": "linear", "type": "llama3", "factor": 2.0})


# ----------------------------------------------------------------------------- threads
@pytest.mark.parametrize("n,error", [(0, ValueError), (-1, ValueError), (True, TypeError),
                                     (1.5, TypeError), ("2", TypeError), (None, TypeError)])
def test_num_threads_refuses_a_bad_count_by_name_and_keeps_the_count(n, error):
    before = torch.get_num_threads()
    with pytest.raises(error, match="n must be a positive int"):
        with num_threads(n):
            pass
    assert torch.get_num_threads() == before


def test_num_threads_nests_and_restores_after_an_exception():
    before = torch.get_num_threads()
    with pytest.raises(KeyError):
        with num_threads(np.int64(1)):
            assert torch.get_num_threads() == 1
            with num_threads(2):
                assert torch.get_num_threads() == 2
            assert torch.get_num_threads() == 1
            raise KeyError("inside")
    assert torch.get_num_threads() == before


# ----------------------------------------------------------------------------- explain
def test_explain_refuses_an_unknown_backend_as_attention_does():
    import mha

    q = torch.randn(1, 2, 4, 8)  # (B, h, T, d)
    with pytest.raises(ValueError, match="backend: unknown backend 'nope'"):
        mha.attention(q, q, q, backend="nope")
    with pytest.raises(ValueError, match="backend: unknown backend 'nope'"):
        mha.explain(q, q, q, backend="nope")
    assert mha.explain(q, q, q, backend="math").chosen == mha.explain(q, q, q).chosen


def test_explain_refuses_an_unknown_argument_by_name():
    import mha

    q = torch.randn(1, 2, 4, 8)  # (B, h, T, d)
    with pytest.raises(TypeError, match=r"explain: unknown argument\(s\) \['casual'\]"):
        mha.explain(q, q, q, casual=True)


# ----------------------------------------------------------------------------- loading weights
def _hf_state(m: Llama) -> dict:
    """``m``'s weights under transformers' names (q / k / v split out of ``in_proj``)."""
    s, out = m.settings, {}
    sizes = [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
    for k, v in m.state_dict().items():
        if k.endswith("in_proj.weight"):
            a = k.removesuffix("in_proj.weight")
            for n, part in zip("qkv", v.split(sizes), strict=True):  # (h d_k | h_kv d_k, d_model)
                out[f"model.{a}{n}_proj.weight"] = part.clone()
        elif k.startswith("lm_head"):
            out[k] = v.clone()
        else:
            out["model." + k.replace("out_proj", "o_proj")] = v.clone()
    return out


def _weights(m: Llama) -> dict:
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_hf_state_round_trip_loads(model):
    other = Llama.from_config(_config())
    other.load_hf_state_dict(_hf_state(model))
    with torch.no_grad():
        assert torch.equal(other(_ids()), model(_ids()))


@pytest.mark.parametrize("key,value,error,words", [
    ("lm_head.weight", "meta", ValueError, r"state\['lm_head.weight'\] is a meta tensor"),
    ("model.norm.weight", np.ones(32, dtype=np.float32), TypeError, "must be a torch.Tensor"),
    ("model.norm.weight", [1.0] * 32, TypeError, "must be a torch.Tensor, got list"),
    ("model.norm.weight", None, TypeError, "must be a torch.Tensor, got NoneType"),
    ("model.norm.weight", torch.ones(32, dtype=torch.bool), TypeError, "floating tensor"),
    ("model.norm.weight", torch.ones(32, dtype=torch.complex64), TypeError, "floating tensor"),
    ("model.embed_tokens.weight", torch.ones(V, 32, dtype=torch.int64), TypeError,
     "floating tensor"),
    (3, torch.zeros(1), TypeError, "keys must be parameter names"),
])
def test_a_bad_value_in_the_hf_state_loads_nothing(model, key, value, error, words):
    state = _hf_state(model)
    state[key] = state[key].to("meta") if isinstance(value, str) else value
    target = Llama.from_config(_config())
    before = _weights(target)
    with pytest.raises(error, match=words):
        target.load_hf_state_dict(state)
    after = _weights(target)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_state_that_is_not_a_mapping_is_refused():
    with pytest.raises(TypeError, match="state must be a mapping"):
        Llama.from_config(_config()).load_hf_state_dict([1, 2])


@pytest.mark.parametrize("bad", ["x", torch.nn.Linear(2, 2)])
def test_from_hf_refuses_what_is_not_a_transformers_model(bad):
    with pytest.raises(TypeError, match="model must be a loaded transformers LlamaForCausalLM"):
        Llama.from_hf(bad)


# ----------------------------------------------------------------------------- mha.llm.native
@pytest.mark.parametrize("ids,error,words", [
    (torch.tensor([1, 2, 3]), ValueError, r"ids must have shape \(1, P\) \(one prompt\), got \(3,\)"),
    (torch.tensor([[1, 2], [3, 4]]), ValueError, r"got \(2, 2\)"),  # a second row: dropped
    (torch.tensor([[1.0, 2.0]]), TypeError, "ids must be an integer tensor"),
    ([[1, 2]], TypeError, "ids must be an integer tensor .* got list"),
    (torch.tensor([[1, V]]), ValueError, r"ids must be token ids of the vocabulary \[0, 50\)"),
])
def test_run_native_refuses_ids_that_are_not_one_prompt(model, ids, error, words):
    from mha.llm.model import Loaded
    from mha.llm.native import run_native

    loaded = Loaded(model=model, tokenizer=None, dtype=torch.float32, attn="mha", impl="mha")
    with pytest.raises(error, match=words):
        run_native(loaded, ids, 2, stop_at_eos=False)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 1e-320},
    {"rope_type": "llama3", "factor": 1e-320, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_a_scaling_whose_frequencies_overflow_is_refused(scaling):
    """A subnormal factor divides the frequencies to inf: every angle, and so every rotated
    value, would be NaN from finite inputs."""
    with pytest.raises(ValueError, match="scaling: the frequencies .* overflow"):
        Rotary(8, scaling=scaling)


@pytest.mark.parametrize("B,T", [(2, 0), (0, 3), (0, 0)])
def test_an_empty_padded_forward_is_empty(model, B, T):
    """No tokens (or no rows): the empty logits, as without attention_mask."""
    ids = torch.zeros(B, T, dtype=torch.int64)  # (B, T)
    with torch.no_grad():
        got = model(ids, attention_mask=torch.ones(B, T, dtype=torch.int64))
    assert got.shape == (B, T, V)
