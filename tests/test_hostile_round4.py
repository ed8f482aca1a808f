"""Hostile use of the newest surfaces: :mod:`mha.sampling`, :class:`mha.models.Llama` and
:class:`mha.MultiHeadAttention` with packed weights (:mod:`mha.llm.weights`), the paged
forwards (:meth:`Llama.forward_paged`, :meth:`mha.MultiHeadAttention.forward_paged`) and
:meth:`Llama.rope_angles`.
Each test gives what a careless or hostile caller would, and expects a refusal that names the
argument, with nothing changed, or the right answer; never a silently wrong one.

Shape legend: R rows of logits, V vocabulary, N tokens of a packed step, S sequences.
Models are small random Llamas built from a config dict (nothing downloaded).
"""

from __future__ import annotations

import pytest
import torch

import mha
from mha.models import Llama
from mha.ops import decode, gemv
from mha.paged import PagedKVCache
from mha.rope import Rotary

CFG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=50, max_position_embeddings=64)

needs_decode = pytest.mark.skipif(decode.unavailable() is not None,
                                  reason=f"decode kernel unavailable: {decode.unavailable()}")


@pytest.fixture(scope="module")
def llama() -> Llama:
    torch.manual_seed(0)
    return Llama.from_config(CFG).eval()


# ----------------------------------------------------------------------------- paged steps
def _step(model: Llama, lengths=(5, 3)):
    """A cache of the model's shape holding sequences of ``lengths`` tokens, just extended by
    all of them: ``(cache, seq_ids, cu_seqlens, ids (1, N), positions (N,))``."""
    s = model.settings
    cache = PagedKVCache(16, 4, s.num_kv_heads, s.head_dim, max_seqs=3, max_len=32,
                         num_layers=s.num_layers)
    seqs = [cache.add_sequence() for _ in lengths]
    cache.extend(seqs, list(lengths))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    ids = torch.arange(3, 3 + cu[-1])[None]  # (1, N)
    positions = torch.cat([torch.arange(n) for n in lengths])  # (N,)
    return cache, seqs, cu, ids, positions


@needs_decode
@pytest.mark.parametrize("shift", ["one token", "one sequence", "past the context"])
def test_paged_positions_that_are_not_the_tokens_places_are_refused(llama, shift):
    """A position other than the token's place in its sequence turns its query and key by
    another RoPE angle: wrong logits with no error, unless refused (naming positions) before
    any page is written."""
    cache, seqs, cu, ids, positions = _step(llama)
    good = llama.forward_paged(ids, positions, cache, seqs, cu)  # (1, N, V)
    bad = positions.clone()
    if shift == "one token":
        bad[6] += 1
    elif shift == "one sequence":
        bad[5:] += 2
    else:
        bad[:] += 1000
    before = cache.state()
    with pytest.raises(ValueError, match="positions must be each token's place"):
        llama.forward_paged(ids, bad, cache, seqs, cu)
    after = cache.state()
    assert all(torch.equal(before[k], after[k]) for k in ("k", "v", "lengths", "block_table"))
    assert torch.equal(llama.forward_paged(ids, positions, cache, seqs, cu), good)


@needs_decode
def test_paged_positions_of_a_cache_extended_more_than_the_step_are_refused(llama):
    """Extended by 9 but fed 3 tokens at 0..2: the tokens land at 6..8, not where their
    positions say."""
    cache, seqs, cu, ids, positions = _step(llama, (5, 3))
    cache.extend([seqs[1]], [6])
    with pytest.raises(ValueError, match="positions must be .* got 0 for token 5, which the "
                                         "cache holds at 6"):
        llama.forward_paged(ids, positions, cache, seqs, cu)
    # the same step at the places the cache holds is served
    right = torch.cat([torch.arange(5), torch.arange(6, 9)])
    assert llama.forward_paged(ids, right, cache, seqs, cu).shape == (1, 8, CFG["vocab_size"])


@needs_decode
@pytest.mark.parametrize("cu", [[0, 5, 7], [0, 4, 7], None])
def test_paged_offsets_that_do_not_cover_the_tokens_name_cu_seqlens(llama, cu):
    cache, seqs, _, ids, positions = _step(llama)
    with pytest.raises(ValueError, match=r"cu_seqlens must cover the step's N = 8 tokens"):
        llama.forward_paged(ids, positions, cache, seqs, cu)


@needs_decode
def test_a_paged_step_not_extended_first_is_refused(llama):
    cache, seqs, cu, ids, positions = _step(llama)
    cache.free(seqs[1])
    seqs[1] = cache.add_sequence()  # holds no token
    with pytest.raises(ValueError, match="holds 0 tokens, fewer than the 3 of this step"):
        llama.forward_paged(ids, positions, cache, seqs, cu)


@needs_decode
def test_the_module_paged_forward_checks_positions_and_offsets():
    torch.manual_seed(0)
    attn = mha.MultiHeadAttention(32, 4, num_kv_heads=2, rope=Rotary(8), bias=False).eval()
    cache = PagedKVCache(8, 4, 2, 8, max_seqs=2, max_len=16)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.extend([a, b], [3, 2])
    x = torch.randn(1, 5, 32)  # (1, N, d_model)
    good = torch.tensor([0, 1, 2, 0, 1])
    with torch.no_grad():
        want = attn.forward_paged(x, cache, 0, [a, b], [0, 3, 5], good)  # (1, N, d_model)
        with pytest.raises(ValueError, match="positions must be each token's place"):
            attn.forward_paged(x, cache, 0, [a, b], [0, 3, 5], torch.tensor([0, 1, 2, 3, 4]))
        with pytest.raises(ValueError, match="cu_seqlens must cover the step's N = 5"):
            attn.forward_paged(x, cache, 0, [a, b], [0, 3, 4], good)
        with pytest.raises(TypeError, match="cache must be a mha.PagedKVCache"):
            attn.forward_paged(x, "pages", 0, [a, b], [0, 3, 5], good)
        assert torch.equal(attn.forward_paged(x, cache, 0, [a, b], [0, 3, 5], good), want)


def test_paged_cache_positions_are_each_sequences_last_places():
    cache = PagedKVCache(8, 4, 1, 8, max_seqs=3, max_len=16)
    a, b, c = (cache.add_sequence() for _ in range(3))
    cache.extend([a, b, c], [6, 2, 1])
    got = cache.positions([c, a, b], [0, 1, 3, 4])  # c's last 1, a's last 2, b's last 1
    assert got.tolist() == [0, 4, 5, 1]
    assert cache.positions([a, b]).tolist() == [5, 1]  # one token each


# ----------------------------------------------------------------------------- sampling
SAMPLED = mha.sampling.SamplingParams(temperature=1.0, seed=0)


@pytest.mark.parametrize("logits", [torch.zeros(2, 0), torch.zeros(1, 3, device="meta")],
                         ids=["V=0", "meta"])
def test_logits_without_tokens_or_values_are_refused_naming_them(logits):
    for p, g in ((mha.sampling.GREEDY, None), (SAMPLED, SAMPLED.generator())):
        with pytest.raises(ValueError, match="logits"):
            mha.sampling.next_tokens(logits, [p] * logits.shape[0], [g] * logits.shape[0])


def test_a_logit_that_requires_grad_samples_without_a_warning(recwarn):
    x = torch.randn(2, 5, requires_grad=True)
    mha.sampling.next_tokens(x, [SAMPLED] * 2, [SAMPLED.generator(i) for i in range(2)])
    assert not [w for w in recwarn if "requires_grad" in str(w.message)]


@pytest.mark.parametrize("row,want", [([0.0, -200.0], 0), ([0.0, 1.0, -200.0], 1),
                                      ([-200.0, 0.0, -200.0], 1)])
def test_a_uniform_next_to_one_never_draws_a_token_of_no_mass(monkeypatch, row, want):
    """u * total rounds up to the total in float32 for u within 2**-24 of 1 (one draw in ~16
    million): the token drawn must still be one with mass, not the last kept token, whose
    exp(x - max) underflows to 0."""
    real = torch.rand

    def near_one(*args, **kwargs):
        return torch.tensor(1.0 - 2.0 ** -53, dtype=torch.float64)

    monkeypatch.setattr(torch, "rand", near_one)
    got = mha.sampling.next_tokens(torch.tensor([row]), [SAMPLED], [SAMPLED.generator()])
    monkeypatch.setattr(torch, "rand", real)
    assert got.tolist() == [want]
    assert mha.sampling.filtered(torch.tensor(row), SAMPLED).softmax(-1)[want] > 0


# ----------------------------------------------------------------------------- rope angles
@pytest.mark.parametrize("args,err,match", [
    ((None, 2, -1), ValueError, "T must be a token count"),
    ((None, 2, 2.5), TypeError, "T must be a token count"),
    ((None, "2", 5), TypeError, "B must be a batch size"),
    ((None, -1, 5), ValueError, "B must be a batch size"),
])
def test_rope_angles_check_their_sizes_by_name(llama, args, err, match):
    """A T < 0 sliced the cached table to T - 1 rows ((1, 63, r) for T = -1): angles of a
    length no call has."""
    x = torch.randn(2, 5, CFG["hidden_size"])
    with pytest.raises(err, match=match):
        llama.rope_angles(*args, x)


@pytest.mark.parametrize("x", [None, torch.ones(2, 5, dtype=torch.long)])
def test_rope_angles_need_the_embedded_tokens(llama, x):
    with pytest.raises(TypeError, match="x must be the embedded tokens"):
        llama.rope_angles(None, 2, 5, x)


# ----------------------------------------------------------------------------- packed weights
@pytest.mark.skipif(gemv.load() is not None, reason=f"packed kernel unavailable: {gemv.load()}")
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_loading_weights_into_a_packed_llama_is_refused_and_changes_nothing(llama, kind):
    """The packed projections hold their weights outside the state dict: a load would change
    the norms and the embedding and keep the projections (load_state_dict reported all keys
    matched), or be refused as 'not this config's weights' naming the model's own keys."""
    import copy

    from mha.llm.weights import pack_weights

    packed = pack_weights(copy.deepcopy(llama), kind)
    torch.manual_seed(1)
    other = pack_weights(Llama.from_config(CFG).eval(), kind)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        before = packed(ids)  # (1, 3, V)
    hf_names = {("model." + k).replace("in_proj", "q_proj"): v for k, v in
                llama.state_dict().items()}
    for load, state in ((packed.load_state_dict, other.state_dict()),
                        (packed.load_hf_state_dict, hf_names)):
        with pytest.raises(ValueError, match=r"projections are packed \(layers.0.self_attn"):
            load(state)
    with torch.no_grad():
        assert torch.equal(packed(ids), before)


def _packed_attention(kind: str, dtype: torch.dtype) -> mha.MultiHeadAttention:
    from mha.llm.weights import pack_weights

    torch.manual_seed(0)
    attn = mha.MultiHeadAttention(32, 4, num_kv_heads=2, bias=False).eval().to(dtype)
    return pack_weights(torch.nn.ModuleDict({"attn": attn}).eval(), kind)["attn"]


@pytest.mark.skipif(gemv.load() is not None, reason=f"packed kernel unavailable: {gemv.load()}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_a_packed_modules_default_cache_has_the_models_dtype(kind, dtype):
    """new_cache() read the packed copy's bf16: a float32 module's cached call was refused as
    'k_new must be torch.bfloat16 like the cache'."""
    attn = _packed_attention(kind, dtype)
    cache = attn.new_cache(1, 8)
    assert cache.dtype == dtype
    x = torch.randn(1, 3, 32, dtype=dtype)
    with torch.no_grad():
        got = attn(x, cache=cache)  # (1, 3, d_model)
        want = attn(x, causal=True)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want)


@pytest.mark.skipif(gemv.load() is not None, reason=f"packed kernel unavailable: {gemv.load()}")
@pytest.mark.parametrize("T", [1, 40], ids=["decode rows", "prefill rows"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_a_packed_projection_refuses_inputs_it_cannot_keep(T, dtype):
    """float64 / float16 inputs failed in the kernel's check ('x must be a float32 or
    bfloat16 CPU tensor') up to 16 rows, and above were rounded to bf16 by the prefill GEMM
    and returned in their dtype, silently."""
    attn = _packed_attention("bf16", torch.float32)
    with torch.no_grad(), pytest.raises(TypeError, match="a packed projection .* takes float32 "
                                                          "or bfloat16 inputs"):
        attn(torch.randn(1, T, 32, dtype=dtype), causal=True)


def test_generate_names_the_row_whose_sampling_is_not_sampling_params(llama):
    ids = torch.tensor([[5, 6], [7, 8]])
    with pytest.raises(TypeError, match=r"sampling\[1\] must be a mha.sampling.SamplingParams"):
        llama.generate(ids, 2, sampling=[SAMPLED, {"temperature": 1.0}])
