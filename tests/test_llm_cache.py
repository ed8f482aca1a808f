"""mha's preallocated K/V cache as transformers' ``Cache`` (:mod:`mha.integrations.hf_cache`),
on small Llama configs with seeded random weights (nothing is downloaded): greedy ``generate``
equals eager's with a plain prompt, left padding and beam search; the storage is written in
place (never reallocated); decode steps get no mask built; refusals leave the cache unchanged.

Shape legend: B batch, h/h_kv heads, P prompt length, N new tokens, d head dim.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers not installed (pip install 'mha[hf]')")

import torch  # noqa: E402

import mha.integrations.hf_cache as hc  # noqa: E402
from tiny_llama import CFG, PROMPTS, eager_and_mha  # noqa: E402

N = 8


@pytest.fixture(scope="module")
def models():
    return eager_and_mha()


def _gen(model, ids, mask, **kw):
    args = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0, **kw)
    if mask is not None:
        args["attention_mask"] = mask
    with torch.no_grad():
        return model.generate(ids, **args)


@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("beams", [1, 2])
def test_greedy_tokens_equal_eager(models, prompt, beams):
    ids, mask = PROMPTS[prompt]
    want = _gen(models["eager"], ids, mask, num_beams=beams)
    B = ids.shape[0] * beams
    cache = hc.MhaCache(models["mha"].config, max_cache_len=ids.shape[1] + N)
    got = _gen(models["mha"], ids, mask, num_beams=beams, cache=cache)
    assert torch.equal(got, want)
    assert cache.get_seq_length() == ids.shape[1] + N - 1  # the last token is never fed back
    assert cache.layers[0].kv.k.shape == (B, CFG.num_key_value_heads, ids.shape[1] + N,
                                          CFG.head_dim)


def test_storage_written_in_place(models):
    """The storage of every layer keeps its address from prefill to the last step (no
    torch.cat, no reallocation), and the views handed to attention point into it."""
    ids, _ = PROMPTS["plain"]
    cache = hc.MhaCache(models["mha"].config, max_cache_len=ids.shape[1] + N)
    seen: list[tuple[int, int]] = []
    layer0 = None

    def spy(module, inputs, output):
        seen.append((layer0.kv.k.data_ptr(), layer0.keys.data_ptr()))

    with torch.no_grad():
        models["mha"](input_ids=ids, cache=cache, use_cache=True)  # prefill allocates
        layer0 = cache.layers[0]
        h = models["mha"].model.layers[0].self_attn.register_forward_hook(spy)
        try:
            _gen(models["mha"], ids, None, cache=hc.MhaCache(models["mha"].config,
                                                             max_cache_len=ids.shape[1] + N))
            tok = torch.tensor([[3], [4]])
            for _ in range(3):
                models["mha"](input_ids=tok, cache=cache, use_cache=True)
        finally:
            h.remove()
    ptrs = {p for p, _ in seen[-3:]}
    assert ptrs == {layer0.kv.k.data_ptr()}
    assert all(view == store for store, view in seen[-3:])
    assert cache.get_seq_length() == ids.shape[1] + 3


def test_decode_steps_build_no_mask(models, monkeypatch):
    """The mask hook returns None for the prompt (Tq = Tk) and for every decode step (Tq = 1)
    when nothing is padded; with left padding it hands over to mask_for_mha (exact)."""
    calls: list[tuple[int, int, bool]] = []
    real = hc.mask_for_cache

    def spy(*args, **kw):
        out = real(*args, **kw)
        calls.append((kw["q_length"], kw["kv_length"], out is None))
        return out

    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register("mha", spy)
    try:
        for prompt, none in (("plain", True), ("left padded", False)):
            calls.clear()
            ids, mask = PROMPTS[prompt]
            cache = hc.MhaCache(models["mha"].config, max_cache_len=ids.shape[1] + N)
            _gen(models["mha"], ids, mask, cache=cache)
            assert len(calls) == N
            assert calls[0][:2] == (ids.shape[1], ids.shape[1])
            assert all(q == 1 for q, _, _ in calls[1:])
            assert all(n is none for _, _, n in calls), calls
    finally:
        hc.register()


def test_chunked_prefill_keeps_the_mask(models):
    """1 < Tq < Tk (a second chunk of prompt) is not skippable: the mask is built, and the
    logits equal those of the prompt in one piece."""
    ids, _ = PROMPTS["plain"]
    m = models["mha"]
    with torch.no_grad():
        whole = m(input_ids=ids).logits[:, -3:]  # (B, 3, V)
        cache = hc.MhaCache(m.config, max_cache_len=ids.shape[1])
        m(input_ids=ids[:, :3], cache=cache, use_cache=True)
        part = m(input_ids=ids[:, 3:], cache=cache, use_cache=True).logits  # (B, 3, V)
    torch.testing.assert_close(part, whole, rtol=1e-5, atol=1e-5)


def _state(cache):
    return [(layer.kv.lengths.clone(), layer.kv.k.clone(), layer.kv.v.clone())
            for layer in cache.layers]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for la, lb in zip(a, b, strict=True)
               for x, y in zip(la, lb, strict=True))


def test_full_cache_refuses_and_is_unchanged(models):
    ids, _ = PROMPTS["plain"]
    m = models["mha"]
    cache = hc.MhaCache(m.config, max_cache_len=ids.shape[1] + 2)
    with torch.no_grad():
        m(input_ids=ids, cache=cache, use_cache=True)
        m(input_ids=ids[:, :1], cache=cache, use_cache=True)
        before = _state(cache)
        with pytest.raises(ValueError, match="MhaCache is full.*unchanged"):
            m(input_ids=ids[:, :2], cache=cache, use_cache=True)
    assert _same(before, _state(cache))
    with torch.no_grad():  # mid-generation: generate asks for more than fits
        with pytest.raises(ValueError, match="max_cache_len=8"):
            _gen(m, ids, None, cache=hc.MhaCache(m.config, max_cache_len=ids.shape[1] + 2))


def test_wrong_dtype_refused_and_unchanged(models):
    """K/V of another dtype than the cache's storage: TypeError, the cache as it was."""
    ids, _ = PROMPTS["plain"]
    m = models["mha"]
    cache = hc.MhaCache(m.config, max_cache_len=16)
    with torch.no_grad():
        m(input_ids=ids, cache=cache, use_cache=True)
    before = _state(cache)
    k = torch.zeros(2, CFG.num_key_value_heads, 1, CFG.head_dim, dtype=torch.float64)
    with pytest.raises(TypeError, match="float32"):
        cache.update(k, k, 0)
    assert _same(before, _state(cache))


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(max_cache_len=0), ValueError, "max_cache_len"),
    (dict(max_cache_len=65), ValueError, "max_position_embeddings=64"),
    (dict(max_cache_len=8, dtype=torch.int8), (TypeError, ValueError), "dtype"),
])
def test_bad_arguments(models, kwargs, err, match):
    with pytest.raises(err, match=match):
        hc.MhaCache(models["mha"].config, **kwargs)


def test_crop_and_reset_change_lengths_only(models):
    ids, _ = PROMPTS["plain"]
    m = models["mha"]
    cache = hc.MhaCache(m.config, max_cache_len=16)
    with torch.no_grad():
        m(input_ids=ids, cache=cache, use_cache=True)
    ptr = cache.layers[1].kv.k.data_ptr()
    cache.crop(-2)
    assert cache.get_seq_length() == ids.shape[1] - 2
    assert cache.layers[1].keys.shape[2] == ids.shape[1] - 2
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.layers[1].kv.k.data_ptr() == ptr


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_static_cache_generation_equals_eager(models, prompt):
    """transformers' own ``cache_implementation="static"`` with attention through mha: its
    cache is not skippable (compileable), so every step gets the mask of the full T_max
    buffer from mask_for_mha, and the tokens equal eager's."""
    ids, mask = PROMPTS[prompt]
    want = _gen(models["eager"], ids, mask)
    got = _gen(models["mha"], ids, mask, cache_implementation="static")
    assert torch.equal(got, want)
