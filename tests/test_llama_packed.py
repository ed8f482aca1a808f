"""mha.models.Llama with packed projection weights (:func:`mha.llm.weights.pack_weights`, bf16
or int8: the attention's ``in_proj`` / ``out_proj``, the MLP's gate + up and down, the LM head),
on the small seeded Llama of tests/tiny_llama.py (vocabulary 101, eos 2; nothing downloaded).

Shape legend: B batch, P prompt tokens, V vocabulary.

The oracle is the fp32 Llama holding the same rounded weights (each packed weight unpacked:
:meth:`mha.ops.gemv.Packed.unpack`). Up to ``GEMV_ROWS`` rows the packed kernel keeps the
activations fp32, so the packed model's logits equal the oracle's up to fp32 summation order
(``DECODE_TOL``); above it (prefill) the bf16 GEMM rounds the activations to bf16, and for int8
its kept copy of the weight (``q * scale``) to bf16 too (``PREFILL_TOL``, relative to the
logits' largest magnitude, ~6 here; measured worst 1.9 % for bf16 and 2.6 % for int8 over three
40-row prompts). Against the unrounded
fp32 Llama the logits move by the weights' rounding: within ``ROUNDED_TOL`` of the largest
logit (measured worst 1.2 % for bf16 and 4.8 % for int8 on the prompts below: this model's
initializer_range of 0.2 makes its weights and logits large).
"""

from __future__ import annotations

import copy

import pytest

transformers = pytest.importorskip("transformers", reason="transformers not installed "
                                   "(pip install 'mha[hf]')")

import torch  # noqa: E402

from mha.llm.serving import Scheduler  # noqa: E402
from mha.llm.weights import GEMV_ROWS, PackedLinear, PackedMLP, pack_weights  # noqa: E402
from mha.models.llama import Llama  # noqa: E402
from mha.ops import decode, gemv  # noqa: E402
from tiny_llama import CFG  # noqa: E402

pytestmark = pytest.mark.skipif(gemv.load() is not None or decode.unavailable() is not None,
                                reason=f"native kernels unavailable: {gemv.load()} "
                                       f"{decode.unavailable()}")

KINDS = ("bf16", "int8")
DECODE_TOL = 2e-5  #: |packed - oracle| up to GEMV_ROWS rows (fp32 activations both)
PREFILL_TOL = {"bf16": 0.03, "int8": 0.04}  #: |packed - oracle| / max |oracle|, > GEMV_ROWS rows
ROUNDED_TOL = {"bf16": 0.03, "int8": 0.1}  #: |packed - fp32 Llama| / max |fp32 Llama|


def _llama(seed: int = 0, tie: bool = False) -> Llama:
    cfg = copy.deepcopy(CFG)
    cfg.tie_word_embeddings = tie
    torch.manual_seed(seed)
    return Llama.from_hf(transformers.LlamaForCausalLM(cfg).eval())


def _oracle(packed: Llama, plain: Llama) -> Llama:
    """``plain`` (fp32) with each weight that ``packed`` packs replaced by its rounded value."""
    out = copy.deepcopy(plain)
    if out.settings.tie_word_embeddings:  # the head gets its own (rounded) copy
        out.lm_head.weight = torch.nn.Parameter(out.lm_head.weight.detach().clone())
    with torch.no_grad():
        for a, b in zip(packed.layers, out.layers, strict=True):
            b.self_attn.in_proj.weight.copy_(a.self_attn.in_proj.packed.unpack())
            b.self_attn.out_proj.weight.copy_(a.self_attn.out_proj.packed.unpack())
            gate, up = a.mlp.gate_up.packed.unpack().split(a.mlp.intermediate)  # (2I, K) -> 2 x (I, K)
            b.mlp.gate_proj.weight.copy_(gate)
            b.mlp.up_proj.weight.copy_(up)
            b.mlp.down_proj.weight.copy_(a.mlp.down_proj.packed.unpack())
        out.lm_head.weight.copy_(packed.lm_head.packed.unpack())
    return out


def _ids(B: int, P: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, CFG.vocab_size, (B, P), generator=g)  # (B, P), no pad / eos


@pytest.fixture(scope="module")
def models():
    """``{kind: (packed, oracle)}`` and the plain fp32 model under ``"fp32"``."""
    plain = _llama()
    out = {"fp32": plain}
    for kind in KINDS:
        packed = pack_weights(copy.deepcopy(plain), kind)
        out[kind] = (packed, _oracle(packed, plain))
    return out


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_every_projection_is_packed(kind, tie):
    m = pack_weights(_llama(tie=tie), kind)
    for layer in m.layers:
        assert isinstance(layer.self_attn.in_proj, PackedLinear)
        assert isinstance(layer.self_attn.out_proj, PackedLinear)
        assert isinstance(layer.mlp, PackedMLP) and layer.mlp.gate_up.kind == kind
    assert isinstance(m.lm_head, PackedLinear) and m.lm_head.kind == kind
    assert isinstance(m.embed_tokens.weight, torch.nn.Parameter)  # the table as loaded
    assert m.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("kind", KINDS)
def test_decode_rows_equal_the_oracle(models, kind):
    """B P <= GEMV_ROWS rows: the packed kernel, fp32 activations."""
    packed, oracle = models[kind]
    ids = _ids(2, 6)  # 12 rows
    assert ids.numel() <= GEMV_ROWS
    with torch.no_grad():
        got, want = packed(ids), oracle(ids)  # (2, 6, V)
    assert (got - want).abs().max().item() <= DECODE_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_rows_are_near_the_oracle(models, kind):
    """B P > GEMV_ROWS rows: torch's bf16 GEMM on the same rounded weights."""
    packed, oracle = models[kind]
    ids = _ids(2, 20)  # 40 rows
    with torch.no_grad():
        got, want = packed(ids), oracle(ids)  # (2, 20, V)
    assert (got - want).abs().max().item() <= PREFILL_TOL[kind] * want.abs().max().item()


@pytest.mark.parametrize("kind", KINDS)
def test_logits_are_within_the_stated_tolerance_of_the_fp32_llama(models, kind):
    packed, _ = models[kind]
    plain = models["fp32"]
    for ids in (_ids(2, 6), _ids(1, 30, seed=2)):
        with torch.no_grad():
            got, want = packed(ids), plain(ids)  # (B, P, V)
        err = (got - want).abs().max().item()
        assert 0 < err <= ROUNDED_TOL[kind] * want.abs().max().item()  # 0: nothing was rounded


@pytest.mark.parametrize("kind", KINDS)
def test_cached_steps_equal_the_full_forward(models, kind):
    """Prefill and one-token steps through the KVCaches (the caches in the model's dtype,
    fp32, though the attention's projections hold bf16 / int8) give the full forward's logits."""
    packed, _ = models[kind]
    ids = _ids(2, 8, seed=3)
    caches = packed.new_caches(2, 8)
    assert all(c.dtype == torch.float32 for c in caches)
    with torch.no_grad():
        steps = [packed(ids[:, :5], caches)] + [packed(ids[:, t:t + 1], caches)
                                                 for t in range(5, 8)]  # (2, 5 | 1, V)
        full = packed(ids)  # (2, 8, V): 16 rows, the packed kernel as the steps
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= DECODE_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_generate_gives_the_oracle_tokens(models, kind):
    packed, oracle = models[kind]
    ids = _ids(2, 6, seed=4)
    got = packed.generate(ids, 12)
    assert got.tolist() == oracle.generate(ids, 12).tolist()


def test_a_bf16_llama_packs_and_decodes():
    """A model in bf16 (``--dtype bf16``): its caches bf16, the logits bf16 and near the
    packed fp32 model's."""
    plain = _llama()
    m = pack_weights(copy.deepcopy(plain).to(torch.bfloat16), "bf16")
    ids = _ids(1, 6, seed=5)
    assert all(c.dtype == torch.bfloat16 for c in m.new_caches(1, 4))
    with torch.no_grad():
        got = m(ids)  # (1, 6, V)
        want = pack_weights(copy.deepcopy(plain), "bf16")(ids)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max().item() <= 0.05 * want.abs().max().item()


def test_the_fused_forward_is_not_taken_with_packed_projections():
    """The fused self-attention reads nn.Linear weights: with packed ones it is refused with
    the reason (and freeze() too), and the step-by-step forward runs."""
    from mha.module import MultiHeadAttention

    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 4, bias=False).eval()
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        want = mha(x, causal=True)
    pack_weights(mha, "bf16")
    reason = mha._why_not_fused(x, True, {"causal": True})
    assert reason is not None and "packed modules" in reason
    with pytest.raises(ValueError, match="nn.Linear projections"):
        mha.freeze()
    with torch.no_grad():
        got = mha(x, causal=True)  # (1, 5, 64)
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()


@pytest.mark.parametrize("kdim", [None, 48])
def test_cross_attention_runs_through_packed_projections(kdim):
    """Key / value given: the packed ``in_proj`` is applied to each input (its part kept), or
    the separate packed q / k / v projections (kdim != d_model) each to its own."""
    from mha.module import MultiHeadAttention

    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 4, kdim=kdim, vdim=kdim).eval()
    x, kv = torch.randn(1, 5, 64), torch.randn(1, 7, kdim or 64)
    with torch.no_grad():
        want = mha(x, kv, kv)
        pack_weights(mha, "bf16")
        got = mha(x, kv, kv)  # (1, 5, 64)
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()


# ------------------------------------------------------------------ serving the packed model
PROMPTS = [_ids(1, n, seed=10 + n)[0].tolist() for n in (3, 9, 17, 5, 22)]


@pytest.mark.parametrize("kind", KINDS)
def test_the_scheduler_serves_the_packed_llama_as_its_generate(models, kind):
    """Batched, chunked (prefill chunks of 8 and decode rows in one step: both the packed
    kernel's and the GEMM's row counts), stopped at either of two eos ids."""
    packed, _ = models[kind]
    want = [packed.generate(torch.tensor([p]), 10)[0, len(p):].tolist() for p in PROMPTS]
    eos = [want[1][3], want[3][5]]  # tokens that the second and fourth prompts generate
    cut = [next((w[:i + 1] for i, t in enumerate(w) if t in eos), w) for w in want]
    assert len(cut[1]) <= 4 and len(cut[3]) <= 6
    s = Scheduler(packed, num_pages=64, page_size=4, max_seqs=8, max_len=48, prefill_chunk=8,
                  eos_token_id=eos)
    rids = [s.add(p, 10) for p in PROMPTS]
    got = s.run()
    assert [got[r] for r in rids] == cut


def test_without_the_packed_kernel_a_loaded_model_keeps_its_weights_and_warns(monkeypatch):
    """pack_loaded (mha generate / chat / serve): the packed kernel refused on this machine
    -> a RuntimeWarning naming why, the model's own nn.Linear weights, "fp32" returned."""
    from mha.llm.weights import pack_loaded

    m = _llama()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    monkeypatch.setattr(gemv, "load", lambda: "no AVX-512 on this CPU")
    with pytest.warns(RuntimeWarning, match="no AVX-512 on this CPU"):
        assert pack_loaded(m, "bf16") == "fp32"
    assert not any(isinstance(x, (PackedLinear, PackedMLP)) for x in m.modules())
    after = m.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k])
                                                  for k in before)
    monkeypatch.undo()  # the kernel runs here (the module's skip): packed
    assert pack_loaded(m, "bf16") == "bf16"
    assert any(isinstance(x, PackedMLP) for x in m.modules())
