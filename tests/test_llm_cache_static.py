"""``MhaCache(..., static=True)``: static shapes for ``torch.compile`` generation.

Shape legend: B batch, h_kv K/V heads, T_max capacity, P prompt length, N new tokens, d head dim.

On a small Llama with seeded random weights (nothing downloaded): eager ``generate`` through the
static cache gives eager attention's greedy tokens (plain and left-padded prompts); attention is
handed the whole ``(B, h_kv, T_max, d)`` storage, written in place; refusals. And the compiled
decode step (transformers' ``compile_config``; on a CPU only with its
``_compile_all_devices`` flag) gives the eager tokens, with the compile checked to have run.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers not installed (pip install 'mha[hf]')")

import torch  # noqa: E402

import mha.integrations.hf_cache as hc  # noqa: E402
from tiny_llama import PROMPTS, eager_and_mha  # noqa: E402

PLAIN, PADDED = PROMPTS["plain"], PROMPTS["left padded"]
N = 8


@pytest.fixture(scope="module")
def models():
    return eager_and_mha()


def _gen(model, prompt, **kw):
    ids, mask = prompt
    args = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0, **kw)
    if mask is not None:
        args["attention_mask"] = mask
    with torch.no_grad():
        return model.generate(ids, **args)


@pytest.mark.parametrize("prompt", [PLAIN, PADDED], ids=["plain", "left padded"])
def test_eager_tokens_equal_and_storage_is_whole(models, prompt):
    cache = hc.MhaCache(models["mha"].config, max_cache_len=32, static=True)
    assert cache.is_compileable
    got = _gen(models["mha"], prompt, cache=cache)
    assert torch.equal(got, _gen(models["eager"], prompt))
    layer = cache.layers[0]
    assert layer.keys.shape == (2, 2, 32, 16)  # (B, h_kv, T_max, d): the whole storage
    assert layer.keys.data_ptr() == layer.kv.k.data_ptr()
    assert int(cache.get_seq_length()) == 6 + N - 1  # the last token is never fed back


def test_refusals(models):
    with pytest.raises(ValueError, match="does not take kv_dtype='int8'"):
        hc.MhaCache(models["mha"].config, max_cache_len=32, static=True, kv_dtype="int8")
    cache = hc.MhaCache(models["mha"].config, max_cache_len=8, static=True)
    with pytest.raises(ValueError, match="MhaCache is full"):
        _gen(models["mha"], PLAIN, cache=cache)
    # the prompt (6) and two decode steps filled it; the refused third step wrote nothing
    assert int(cache.get_seq_length()) == 8


@pytest.mark.slow
def test_compiled_decode_tokens_equal_eager(models):
    from transformers.generation.configuration_utils import CompileConfig

    torch._dynamo.reset()
    cc = CompileConfig(fullgraph=True, dynamic=False)
    cc._compile_all_devices = True  # transformers compiles on a CPU only with this flag
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    cache = hc.MhaCache(models["mha"].config, max_cache_len=32, static=True)
    got = _gen(models["mha"], PLAIN, cache=cache, compile_config=cc)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before  # it compiled
    assert torch.equal(got, _gen(models["eager"], PLAIN))


@pytest.mark.slow
def test_compiled_forward_with_packed_weights_equals_eager(models):
    """The decode step called directly (as ``mha bench --suite llm`` does), the whole forward
    compiled (fullgraph) with packed bf16 weights and a bf16 static cache: the mask is built in
    the graph (its offsets are tensors while tracing) and the logits equal the eager step's."""
    import copy as _copy

    from mha.llm.weights import pack_weights

    model = pack_weights(_copy.deepcopy(models["mha"]), weights="bf16")
    ids, _ = PLAIN  # (2, 6)
    P, T_max = ids.shape[1], 16
    caches = {}
    with torch.no_grad():
        for kind in ("eager", "compiled"):
            cache = hc.MhaCache(model.config, max_cache_len=T_max, kv_dtype="bf16", static=True)
            model(input_ids=ids, attention_mask=torch.ones(2, T_max, dtype=torch.long),
                  cache=cache, use_cache=True)
            caches[kind] = cache
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, fullgraph=True, dynamic=False)
        tok = torch.tensor([[7], [8]])  # (B, 1)
        for t in range(3):
            pos = torch.tensor([P + t])
            kw = dict(input_ids=tok, attention_mask=torch.ones(2, T_max, dtype=torch.long),
                      position_ids=pos[None].expand(2, 1), cache_position=pos, use_cache=True)
            want = model(cache=caches["eager"], **kw).logits[:, -1]  # (B, V)
            got = compiled(cache=caches["compiled"], **kw).logits[:, -1]
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
            tok = want.argmax(-1, keepdim=True)  # (B, 1)
    assert int(caches["compiled"].get_seq_length()) == P + 3
