"""Rotary position embeddings (mha.rope, MultiHeadAttention(rope=...)): against transformers'
Llama / GPT-J rotary code and a float64 pair-by-pair formula, a transformers LlamaAttention with
the same weights, and in every mode of the module (plain with positions, cached decoding with
ragged and left-padded rows, packed sequences, trace, torch.export, ONNX export), plus refusals.

Shape legend: B batch, T lengths, h/h_kv heads, d head dim, r rotated dims, d_model width.
"""

from __future__ import annotations

import math

import pytest
import torch

import mha
from mha.cache import ConcatKVCache
from mha.rope import Rotary

from oracle import FLOOR, max_err

tf = pytest.importorskip("transformers", reason="the hf extra: pip install 'mha[hf]'")
from transformers.models.llama import modeling_llama as llama  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # 32: every regime occurs for d = 16
SCALINGS = {"default": None, "linear": {"rope_type": "linear", "factor": 4.0}, "llama3": LLAMA3}


def _llama_config(scaling, theta=500000.0, **kw) -> tf.LlamaConfig:
    params = dict(scaling or {"rope_type": "default"}, rope_theta=theta)
    cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=256, rope_parameters=params, attention_bias=False)
    cfg.update(kw)
    return tf.LlamaConfig(**cfg)


def hand_rotary(x, positions, r, theta, interleaved, inv_freq=None):
    """The float64 formula, one pair at a time: ``x (B, H, T, d)``, ``positions (B|1, T)``."""
    x = x.double()
    out = x.clone()
    w = inv_freq if inv_freq is not None else torch.tensor(
        [theta ** (-2 * i / r) for i in range(r // 2)], dtype=torch.float64)
    pos = positions.double().expand(x.shape[0], -1)  # (B, T)
    for i in range(r // 2):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + r // 2)
        ang = pos * w[i]  # (B, T)
        c, s = ang.cos()[:, None], ang.sin()[:, None]  # (B, 1, T)
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


# ----------------------------------------------------------------------------- the rotation
@pytest.mark.parametrize("scaling", sorted(SCALINGS))
def test_matches_transformers_llama_rotary(scaling):
    cfg = _llama_config(SCALINGS[scaling])
    emb = llama.LlamaRotaryEmbedding(cfg)
    rot = Rotary(16, theta=500000.0, scaling=SCALINGS[scaling])
    assert max_err(rot.inv_freq(), emb.inv_freq) < 1e-7 * emb.inv_freq.abs().max()
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 40, 16), torch.randn(2, 2, 40, 16)
    pos = torch.arange(40)[None] + torch.tensor([[0], [9]])  # (B, T): row 1 starts at 9
    cos, sin = emb(q, pos)
    q_hf, k_hf = llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert max_err(rot.apply_rotary(q, pos), q_hf) < 1e-5
    assert max_err(rot.apply_rotary(k, pos), k_hf) < 1e-5
    # positions (T,) and None are row 0's
    assert torch.equal(rot.apply_rotary(q, pos[0]), rot.apply_rotary(q))
    assert max_err(rot.apply_rotary(q)[0], q_hf[0]) < 1e-5


@pytest.mark.parametrize("r", [8, 16])
def test_interleaved_partial_matches_transformers_gptj(r):
    """GPT-J rotates neighbouring pairs of the first rotary_dim dims (theta 10000)."""
    from transformers.models.gptj import modeling_gptj as gptj

    torch.manual_seed(1)
    x = torch.randn(2, 3, 12, 16)  # (B, H, T, d)
    pos = torch.arange(12)[None].expand(2, -1) + torch.tensor([[0], [5]])  # (B, T)
    sin, cos = torch.split(gptj.create_sinusoidal_positions(64, r)[pos], r // 2, dim=-1)
    xt = x.transpose(1, 2)  # (B, H, T, d) -> (B, T, H, d): GPT-J's layout
    rot_hf = gptj.apply_rotary_pos_emb(xt[..., :r], sin, cos)  # (B, T, H, r)
    want = torch.cat([rot_hf, xt[..., r:]], dim=-1).transpose(1, 2)  # -> (B, H, T, d)
    got = Rotary(r, interleaved=True).apply_rotary(x, pos)
    assert max_err(got, want) < 1e-5


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("r", [4, 10, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_matches_the_float64_formula(interleaved, r, dtype):
    """Partial rotary (r < d: dims r.. pass unchanged) and both pairings, by the formula; each
    result is rounded once from float32 (or computed in float64)."""
    torch.manual_seed(2)
    x = torch.randn(2, 3, 9, 16).to(dtype)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [3, 3, 3, 3, 4, 5, 6, 900, 4095]])
    got = Rotary(r, theta=1000.0, interleaved=interleaved).apply_rotary(x, pos)
    want = hand_rotary(x, pos, r, 1000.0, interleaved)
    assert got.dtype == dtype
    tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2 ** -8 * 4}[dtype]
    assert max_err(got, want) <= tol
    assert torch.equal(got[..., r:], x[..., r:])


def test_llama3_scaling_by_the_formula():
    rot = Rotary(16, theta=500000.0, scaling=LLAMA3)
    f, lo, hi, L = 8.0, 1.0, 4.0, 32.0
    for i, w in enumerate(rot.inv_freq().tolist()):
        w0 = 500000.0 ** (-2 * i / 16)
        lam = 2 * math.pi / w0
        s = (L / lam - lo) / (hi - lo)
        want = w0 if lam < L / hi else w0 / f if lam > L / lo else (1 - s) * w0 / f + s * w0
        assert w == pytest.approx(want, rel=1e-14)


def test_table_grows_and_equals_direct_computation():
    rot = Rotary(8)
    x = torch.randn(1, 1, 3, 8)
    small = rot.apply_rotary(x, torch.tensor([1, 2, 3]))
    big = rot.apply_rotary(x, torch.tensor([1, 2, 5000]))  # grows the table past 4096
    assert torch.equal(small[..., :2, :], big[..., :2, :])
    C64, S64 = rot.angles(torch.tensor([5000]), 1, 1, torch.device("cpu"), torch.float64)
    C32, S32 = rot.angles(torch.tensor([5000]), 1, 1, torch.device("cpu"))  # from the table
    assert C32.dtype == torch.float32 and max_err(C32, C64) < 1e-7 and max_err(S32, S64) < 1e-7


def test_config_is_frozen_hashable_and_reads_hf_parameters():
    a = Rotary(16, theta=5e5, scaling=dict(LLAMA3, rope_theta=5e5))  # a config entry as is
    b = Rotary(16, theta=500000, scaling=LLAMA3)
    assert a == b and hash(a) == hash(b) and "llama3" in repr(a)
    assert Rotary(16, scaling={"rope_type": "default", "rope_theta": 1e4}).scaling is None
    assert Rotary(16, scaling={"type": "linear", "factor": 2}) == \
        Rotary(16, scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(AttributeError):
        a.theta = 1.0


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(dim=7), ValueError, "dim must be an even"),
    (dict(dim=0), ValueError, "dim must be"),
    (dict(dim=8.0), TypeError, "dim must be"),
    (dict(dim=8, theta=0.0), ValueError, "theta must be"),
    (dict(dim=8, theta=-1.0), ValueError, "theta must"),
    (dict(dim=8, theta=float("nan")), ValueError, "theta must"),
    (dict(dim=8, theta=float("inf")), ValueError, "theta must"),
    (dict(dim=8, interleaved=1), TypeError, "interleaved must be a bool"),
    (dict(dim=8, scaling="linear"), TypeError, "scaling must be None or a dict"),
    (dict(dim=8, scaling={"rope_type": "yarn", "factor": 2.0}), ValueError, "rope_type must"),
    (dict(dim=8, scaling={"rope_type": "linear"}), ValueError, "missing ['factor']"),
    (dict(dim=8, scaling={"rope_type": "linear", "factor": 0.0}), ValueError, "> 0"),
    (dict(dim=8, scaling={"rope_type": "linear", "factor": 2.0, "beta": 1}), ValueError,
     "unknown keys ['beta']"),
    (dict(dim=8, scaling=dict(LLAMA3, high_freq_factor=0.5)), ValueError, "high_freq_factor"),
])
def test_rotary_refusals_name_the_argument(kwargs, error, words):
    with pytest.raises(error, match=None) as e:
        Rotary(**kwargs)
    assert words in str(e.value)


@pytest.mark.parametrize("positions, error, words", [
    (torch.tensor([0.0, 1.0, 2.0]), TypeError, "positions must be an integer tensor"),
    (torch.tensor([True, False, True]), TypeError, "positions must be an integer tensor"),
    (torch.tensor([0, -1, 2]), ValueError, "positions must be >= 0"),
    (torch.arange(4), ValueError, "positions must have shape (T,) = (3,)"),
    (torch.zeros(3, 3, dtype=torch.int64), ValueError, "positions must have shape"),
])
def test_positions_refusals_name_the_argument(positions, error, words):
    with pytest.raises(error) as e:
        Rotary(8).apply_rotary(torch.randn(2, 1, 3, 8), positions)
    assert words in str(e.value)


# ----------------------------------------------------------------------------- the module
def _llama_pair(scaling=None, dtype=torch.float32, seed=3):
    """A transformers LlamaAttention (GQA 4/2, d = 16, eager) and mha's module with its weights."""
    cfg = _llama_config(scaling)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = llama.LlamaAttention(cfg, layer_idx=0).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    m = mha.MultiHeadAttention(64, 4, num_kv_heads=2, bias=False,
                               rope=Rotary(16, theta=500000.0, scaling=scaling)).eval()
    with torch.no_grad():
        m.in_proj.weight.copy_(torch.cat([hf.q_proj.weight, hf.k_proj.weight, hf.v_proj.weight]))
        m.out_proj.weight.copy_(hf.o_proj.weight)
    return cfg, hf.to(dtype), m.to(dtype)


def _hf_call(cfg, hf, x, pos):
    """LlamaAttention with an additive causal mask ``(1, 1, T, T)`` at ``positions (B, T)``."""
    T = x.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = torch.zeros(T, T, dtype=x.dtype).masked_fill(~causal, float("-inf"))[None, None]
    emb = llama.LlamaRotaryEmbedding(cfg)
    return hf(x, position_embeddings=emb(x, pos), attention_mask=mask)[0]


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
def test_module_equals_transformers_llama_attention_fp32(scaling):
    cfg, hf, m = _llama_pair(SCALINGS[scaling])
    x = torch.randn(2, 37, 64)
    pos = torch.arange(37)[None].expand(2, -1)
    with torch.no_grad():
        want, got = _hf_call(cfg, hf, x, pos), m(x, causal=True)
    assert max_err(got, want) < 1e-4 * want.abs().max()


def test_module_equals_transformers_llama_attention_bf16():
    """bf16 (transformers rotates in bf16, mha in float32 rounded once): mha's error against
    the float64 LlamaAttention is at most twice transformers' own bf16 error, plus the floor."""
    cfg, hf64, _ = _llama_pair(LLAMA3, torch.float64)
    _, hf16, m16 = _llama_pair(LLAMA3, torch.bfloat16)
    x = torch.randn(2, 29, 64)
    pos = torch.arange(29)[None].expand(2, -1)
    with torch.no_grad():
        ref = _hf_call(cfg, hf64, x.double(), pos)
        low = _hf_call(cfg, hf16, x.bfloat16(), pos)
        got = m16(x.bfloat16(), causal=True)
    assert got.dtype == torch.bfloat16
    assert max_err(got, ref) <= 2 * max_err(low, ref) + FLOOR[torch.bfloat16]


def make(seed=4, **kw) -> mha.MultiHeadAttention:
    torch.manual_seed(seed)
    kw.setdefault("rope", Rotary(8, theta=100.0))  # partial: d = 12, r = 8
    return mha.MultiHeadAttention(24, 4, num_kv_heads=2, head_dim=12, **kw).eval()


def test_positions_per_row_serve_a_left_padded_batch():
    """transformers-style position_ids ``(B, T)`` counting from each row's first real token:
    the padded row's real tokens equal the unpadded call."""
    m = make()
    x = torch.randn(1, 5, 24)
    with torch.no_grad():
        alone = m(x, causal=True)  # (1, 5, d_model)
        padded = torch.cat([torch.cat([torch.randn(1, 2, 24), x[:, :3]], 1), x], 0)  # (2, 5, ..)
        keep = torch.ones(2, 5, dtype=torch.bool)
        keep[0, :2] = False
        pos = (keep.cumsum(1) - 1).clamp(min=0)  # (B, T): [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
        mask = keep[:, None, None, :] & torch.ones(5, 5, dtype=torch.bool).tril()  # (B, 1, T, T)
        y = m(padded, mask=mask, positions=pos)
    assert max_err(y[1], alone[0]) < 1e-5
    assert max_err(y[0, 2:], alone[0, :3]) < 1e-5
    # RoPE is relative and the padding is masked, so the outputs alone would agree with the
    # positions ignored: the rotated Q and K the module computes are checked against the
    # formula at pos too
    rotated = _rotated_heads(m, padded, mask=mask, positions=pos)  # Q then K, (B, T, heads, d)
    with torch.no_grad():
        q, k, _ = m.project(padded, padded, padded, True)  # (B, T, h*d), (B, T, h_kv*d), ..
    for got, flat, heads in zip(rotated, (q, k), (4, 2), strict=True):
        want = hand_rotary(flat.view(2, 5, heads, 12).transpose(1, 2), pos, 8, 100.0, False)
        assert max_err(got.transpose(1, 2), want) < 1e-5  # (B, heads, T, d) each


def _rotated_heads(m, x, **kw) -> list[torch.Tensor]:
    """The rotated Q ``(B, T, h, d)`` and K ``(B, T, h_kv, d)`` of ``m(x, **kw)``, from what
    Rotary.rotate_tokens returns: one call on the ``h + h_kv`` heads (Q's and K's columns of
    the QKV GEMM's output), split here, or one call each."""
    seen = []
    real = Rotary.rotate_tokens

    def spy(self, *args):
        seen.append(real(self, *args))
        return seen[-1]

    Rotary.rotate_tokens = spy
    try:
        with torch.no_grad():
            m(x, **kw)
    finally:
        Rotary.rotate_tokens = real
    if len(seen) == 1:
        return [seen[0][:, :, :m.num_heads], seen[0][:, :, m.num_heads:]]
    return seen


@pytest.mark.parametrize("shift", [1, 100, 3000])
def test_shifting_every_position_changes_nothing(shift):
    m = make(rope=Rotary(12, theta=10000.0))
    x = torch.randn(2, 9, 24)
    with torch.no_grad():
        y0 = m(x, causal=True)
        y1 = m(x, causal=True, positions=torch.arange(9) + shift)
    assert max_err(y0, y1) < 1e-4 * y0.abs().max()
    with torch.no_grad():  # and rotation matters at all: other relative positions differ
        y2 = m(x, causal=True, positions=torch.arange(9) * 2)
    assert max_err(y0, y2) > 1e-2


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_decoding_step_by_step_equals_one_causal_call_with_ragged_rows(interleaved, kv_dtype):
    """Prefill, cut row 0 back (ragged), then single steps: each row's outputs equal the full
    causal call over that row's own sequence (positions from each row's cache length)."""
    m = make(rope=Rotary(8, theta=100.0, interleaved=interleaved))
    torch.manual_seed(5)
    prompt, steps = torch.randn(2, 5, 24), torch.randn(2, 3, 24)
    keep = [3, 5]
    seqs = [torch.cat([prompt[b, :keep[b]], steps[b]]) for b in range(2)]  # (keep[b] + 3, ..)
    cache = m.new_cache(2, 10, kv_dtype=kv_dtype)
    with torch.no_grad():
        m(prompt, cache=cache)
        cache.truncate(torch.tensor(keep))
        outs = [m(steps[:, t:t + 1], cache=cache) for t in range(3)]  # 3 x (B, 1, d_model)
        for b in range(2):
            full = m(seqs[b][None], causal=True)  # (1, T_b, d_model)
            got = torch.cat([o[b] for o in outs])  # (3, d_model)
            assert max_err(got, full[0, -3:]) < (5e-2 if kv_dtype else 1e-5), f"row {b}"


def test_left_padded_cache_decodes_like_the_unpadded_sequence():
    m = make()
    x = torch.randn(1, 7, 24)
    with torch.no_grad():
        full = m(x, causal=True)
        padded = torch.cat([torch.cat([torch.randn(1, 2, 24), x[:, :4]], 1),
                            torch.cat([x[:, :2], x[:, :4]], 1)])  # (2, 6, d_model)
        cache = m.new_cache(2, 12)
        cache.mark_left_padding(torch.tensor([2, 0]))
        m(padded, cache=cache)
        y = torch.cat([m(torch.cat([x[:, t:t + 1]] * 2), cache=cache) for t in (4, 5, 6)], 1)
    assert max_err(y[0], full[0, 4:]) < 1e-5


def test_chunked_prefill_and_concat_cache():
    m = make()
    x = torch.randn(2, 8, 24)
    with torch.no_grad():
        full = m(x, causal=True)
        for cache in (m.new_cache(2, 8), ConcatKVCache()):
            y = torch.cat([m(x[:, :3], cache=cache), m(x[:, 3:7], cache=cache),
                           m(x[:, 7:], cache=cache)], 1)
            assert max_err(y, full) < 1e-5, type(cache).__name__


@pytest.mark.parametrize("causal", [False, True])
def test_packed_equals_each_sequence_alone(causal):
    """Positions restart at 0 in each packed sequence."""
    m = make()
    lengths = [3, 1, 5, 0]
    seqs = [torch.randn(1, n, 24) for n in lengths]
    cu = torch.tensor([0, 3, 4, 9, 9])
    with torch.no_grad():
        y = m(torch.cat(seqs, 1), cu_seqlens=cu, causal=causal)  # (1, 9, d_model)
        alone = torch.cat([m(s, causal=causal) for s in seqs if s.shape[1]], 1)
    assert max_err(y, alone) < 1e-5


def test_packed_positions_restart_in_each_sequence():
    """RoPE is relative, so packed outputs cannot tell restarted positions from running ones
    (test_packed_equals_each_sequence_alone holds either way): the angles are checked directly."""
    m = make()
    cos, sin = m._rope_angles(torch.randn(1, 9, 24), None, None, torch.tensor([0, 3, 4, 9, 9]))
    want = m.rope.angles(torch.tensor([0, 1, 2, 0, 0, 1, 2, 3, 4]), 1, 9, torch.device("cpu"))
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])


def test_refusals_name_the_argument_and_change_nothing():
    for rope, error, words in ((1, TypeError, "rope must be None, True"),
                               ("yes", TypeError, "rope must be"),
                               (Rotary(16), ValueError, "rope: Rotary.dim=16 exceeds head_dim=12")):
        with pytest.raises(error, match=None) as e:
            make(rope=rope)
        assert words in str(e.value)
    m = make()
    x = torch.randn(2, 4, 24)
    cache = m.new_cache(2, 8)
    before = {n: t.clone() for n, t in m.state_dict().items()}
    calls = (
        (dict(key=torch.randn(2, 5, 24)), "rope: cross-attention"),
        (dict(cache=cache, positions=torch.arange(4)), "positions must be None with cache"),
        (dict(cu_seqlens=torch.tensor([0, 4]), positions=torch.arange(4)),
         "positions must be None with cu_seqlens"),
        (dict(positions=torch.arange(4) - 1), "positions must be >= 0"),
        (dict(positions=torch.arange(5)), "positions must have shape"),
        (dict(positions=torch.arange(4.0)), "positions must be an integer tensor"),
    )
    for kw, words in calls:
        if "cu_seqlens" in kw:
            x_call = x[:1]
        else:
            x_call = x
        with pytest.raises((ValueError, TypeError)) as e:
            m(x_call, **kw)
        assert words in str(e.value), kw
        assert cache.lengths.tolist() == [0, 0]
    assert all(torch.equal(t, before[n]) for n, t in m.state_dict().items())
    with pytest.raises(ValueError, match="positions: this module has no rope"):
        mha.MultiHeadAttention(24, 4)(x, positions=torch.arange(4))
    with pytest.raises(ValueError, match="to_torch: torch.nn.MultiheadAttention has no rope"):
        mha.MultiHeadAttention(24, 4, rope=True).to_torch()


def test_state_dict_has_no_rope_entries():
    with_rope, without = make(seed=6, rope=True), make(seed=6, rope=None)
    assert with_rope.state_dict().keys() == without.state_dict().keys()
    with_rope.load_state_dict(without.state_dict())
    assert "rope=Rotary(dim=12, theta=10000.0)" in repr(with_rope)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_turns_q_and_k_and_says_so(dtype):
    """Where the fused forward runs, it runs with rope too (RoPE named on explain's last line),
    and the rotation is applied."""
    m = mha.MultiHeadAttention(64, 4, rope=True).to(dtype).eval()
    x = torch.randn(2, 5, 64, dtype=dtype)
    with torch.no_grad():
        line = m.explain(x).splitlines()[-1]
        ref = mha.MultiHeadAttention(64, 4).to(dtype).eval()
        ref.load_state_dict(m.state_dict())
        assert "RoPE" not in ref.explain(x).splitlines()[-1]
        assert line.startswith("forward: fused") == \
            ref.explain(x).splitlines()[-1].startswith("forward: fused")
        if line.startswith("forward: fused"):
            assert "RoPE on Q and K" in line
        assert max_err(m(x), ref(x)) > 1e-3  # the rotation was applied


def test_trace_records_the_rotated_heads():
    m = make()
    t = mha.trace(m, torch.randn(2, 5, 24))
    names = [s.step for s in t]
    i = names.index("rotate Q (RoPE)")
    assert names[i - 1] == "project V" and names[i + 1:i + 3] == ["rotate K (RoPE)",
                                                                  "split heads Q"]
    assert tuple(t[i].shape) == (2, 5, 4, 12) and tuple(t[i + 1].shape) == (2, 5, 2, 12)


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_with_dynamic_length(strict):
    from torch.export import Dim, export

    m = mha.MultiHeadAttention(64, 4, num_kv_heads=2, rope=Rotary(16, theta=1e4)).eval()

    class Causal(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x, causal=True)  # (B, T, d_model)

    model = Causal()
    B, T = Dim("B", min=1, max=64), Dim("T", min=1, max=4096)
    ep = export(model, (torch.randn(2, 33, 64),), dynamic_shapes=({0: B, 1: T},), strict=strict)
    for b, t in ((1, 1), (2, 7), (1, 600)):
        x = torch.randn(b, t, 64)
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_with_positions_as_an_input(strict):
    """transformers-style position_ids (B, T) as a graph input, B and T dynamic."""
    from torch.export import Dim, export

    m = mha.MultiHeadAttention(64, 4, rope=Rotary(16, scaling=LLAMA3)).eval()

    class WithPositions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x, positions):
            return self.m(x, causal=True, positions=positions)  # (B, T, d_model)

    model = WithPositions()
    B, T = Dim("B", min=1, max=64), Dim("T", min=2, max=4096)
    pos = torch.arange(33)[None].repeat(2, 1)  # (B, T)
    ep = export(model, (torch.randn(2, 33, 64), pos), dynamic_shapes=({0: B, 1: T}, {0: B, 1: T}),
                strict=strict)
    x, pos = torch.randn(3, 50, 64), torch.arange(50)[None] + torch.tensor([[0], [5], [900]])
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x, pos), model(x, pos), rtol=1e-5, atol=1e-5)


def test_onnx_export_self_attention_and_decode_step(tmp_path):
    pytest.importorskip("onnx", reason="the onnx extra: pip install 'mha[onnx]'")
    ort = pytest.importorskip("onnxruntime", reason="the onnx extra: pip install 'mha[onnx]'")
    pytest.importorskip("onnxscript", reason="the onnx extra: pip install 'mha[onnx]'")
    from mha import export

    def run(path, feeds):
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        outs = sess.run(None, {k: v.numpy() for k, v in feeds.items()})
        return [torch.from_numpy(o) for o in outs]

    torch.manual_seed(7)
    m = mha.MultiHeadAttention(32, 4, num_kv_heads=2, rope=Rotary(6, interleaved=True)).eval()
    path = export.onnx(export.SelfAttention(m, causal=True), (torch.randn(2, 9, 32),),
                       tmp_path / "sa.onnx", input_names=["x"], output_names=["y"],
                       dynamic_shapes=({0: "B", 1: "T"},))
    x = torch.randn(3, 13, 32)
    with torch.no_grad():
        torch.testing.assert_close(run(path, {"x": x})[0], m(x, causal=True), rtol=1e-5, atol=1e-5)
    path = export.onnx(export.DecodeStep(m), (torch.randn(2, 1, 32), torch.randn(2, 2, 3, 8),
                                              torch.randn(2, 2, 3, 8)),
                       tmp_path / "step.onnx", input_names=["x", "past_k", "past_v"],
                       output_names=["y", "present_k", "present_v"],
                       dynamic_shapes=({0: "B", 1: "Tn"}, {0: "B", 2: "P"}, {0: "B", 2: "P"}))
    cache = m.new_cache(2, 16)
    with torch.no_grad():
        m(torch.randn(2, 4, 32), cache=cache)
        past_k, past_v = cache.keys().clone(), cache.values().clone()
        for t in range(3):
            x = torch.randn(2, 1, 32)
            want = m(x, cache=cache)
            y, past_k, past_v = run(path, {"x": x, "past_k": past_k, "past_v": past_v})
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5, msg=f"step {t}")
            torch.testing.assert_close(past_k, cache.keys(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_sequence_shards_turned_at_global_positions_equal_the_full_rotation(layout):
    """The recipe of docs/distributed.md: each rank turns its shard at
    mha.distributed.layout.positions; shard by shard that is the full sequence's rotation."""
    from mha.distributed.layout import positions, shard

    rot = Rotary(8, theta=100.0)
    q = torch.randn(2, 3, 16, 8)  # (B, h, T, d)
    full = rot.apply_rotary(q)
    for r in range(4):
        got = rot.apply_rotary(shard(q, 4, r, layout=layout), positions(16, 4, r, layout))
        assert torch.equal(got, shard(full, 4, r, layout=layout)), f"rank {r}"
        local = rot.apply_rotary(shard(q, 4, r, layout=layout))  # positions restarting at 0
        assert r == 0 and layout == "contiguous" or not torch.equal(local, got)


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradients_through_the_rotation(interleaved):
    """Training: the module's gradients with rope (float64 gradcheck of the rotation, and the
    module's input gradient against finite differences)."""
    rot = Rotary(6, theta=50.0, interleaved=interleaved)
    x = torch.randn(2, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 3, 3, 0, 9]])
    assert torch.autograd.gradcheck(lambda t: rot.apply_rotary(t, pos), (x,))
    m = make(rope=rot).double().train()
    xm = torch.randn(1, 4, 24, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: m(t, causal=True, backend="math"), (xm,))


def test_fullgraph_compile_with_positions():
    """torch.compile(fullgraph=True): the angles are computed from the positions in the graph
    (no table, no value read), equal to eager's table within float32 rounding."""
    m = make(rope=Rotary(12, interleaved=True))
    x, pos = torch.randn(2, 9, 24), torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [2] * 9])
    compiled = torch.compile(lambda x, p: m(x, causal=True, positions=p), fullgraph=True)
    with torch.no_grad():
        got = compiled(x, pos)
        torch.testing.assert_close(got, m(x, causal=True, positions=pos), rtol=1e-5, atol=1e-5)
        # and both against the formula at pos (row 1 sits at one position: no rotation
        # between its tokens, unlike 0 .. 8)
        projected = m.project(x, x, x, True)  # (B, T, h*d), (B, T, h_kv*d) x 2
        q, k, v = (m.split_heads(t, n) for t, n in zip(projected, (4, 2, 2), strict=True))
        q = hand_rotary(q, pos, 12, 10000.0, True)  # (B, h, T, d)
        k = hand_rotary(k, pos, 12, 10000.0, True).repeat_interleave(2, 1)  # (B, h, T, d)
        v = v.double().repeat_interleave(2, 1)  # (B, h_kv, T, d) -> (B, h, T, d)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        want = m.out_proj(m.merge_heads(out).float())  # (B, T, d_model)
    assert max_err(got, want) < 1e-5


# ----------------------------------------------------------------------------- hostile positions
def test_small_integer_dtypes_are_positions():
    """uint8 / int8 / int16 / int32 positions rotate as their int64 values (not as masks)."""
    rot = Rotary(8, theta=100.0)
    x = torch.randn(2, 1, 3, 8)
    pos = torch.tensor([[0, 5, 9], [2, 3, 4]])
    want = rot.apply_rotary(x, pos)
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32):
        assert torch.equal(rot.apply_rotary(x, pos.to(dtype)), want), dtype
        assert torch.equal(rot.apply_rotary(x, pos[0].to(dtype)), rot.apply_rotary(x, pos[0]))


def test_a_far_position_is_computed_without_growing_the_table():
    """Positions past the cached table's cap take the same float64 formula directly: no table
    of that size is allocated or kept, and the result matches the formula."""
    from mha.rope import _TABLE_CAP, MAX_POSITION

    rot = Rotary(8, theta=10000.0)
    x = torch.randn(1, 1, 3, 8, dtype=torch.float64)
    for far in (300_000, 2 ** 24, MAX_POSITION):
        pos = torch.tensor([1, far - 1, far])
        got = rot.apply_rotary(x.float(), pos)
        want = hand_rotary(x, pos[None], 8, 10000.0, False)
        assert max_err(got, want) < 1e-5, far
        assert all(t[0].shape[0] <= _TABLE_CAP for t in rot._tables.values())
    with pytest.raises(ValueError, match=r"positions must be < 2\*\*31"):
        rot.apply_rotary(x, torch.tensor([0, 1, torch.iinfo(torch.int64).max]))
    with pytest.raises(ValueError, match=r"positions must be < 2\*\*31.*got a maximum of 2199"):
        rot.apply_rotary(x, torch.tensor([0, 1, 2 ** 41]))


def test_pickling_drops_the_cached_tables(tmp_path):
    import io as bytes_io
    import pickle

    m = make(rope=Rotary(12))
    m.eval()

    def saved_size() -> int:
        buf = bytes_io.BytesIO()
        torch.save(m, buf)
        return buf.tell()

    small = saved_size()
    with torch.no_grad():
        m(torch.randn(1, 3, 24), positions=torch.tensor([0, 20_000, 30_000]))
    assert m.rope._tables  # cached for the calls
    assert saved_size() < small + 1000
    back = pickle.loads(pickle.dumps(m.rope))
    assert back == m.rope and not back._tables
    y, pos = torch.randn(1, 1, 2, 12), torch.tensor([0, 30_000])
    assert torch.equal(back.apply_rotary(y, pos), m.rope.apply_rotary(y, pos))


def test_a_query_batch_unlike_the_cache_is_named():
    """With a cache, the query's batch and device are checked against it before anything is
    computed, naming query (not the positions the cache would supply)."""
    m = make()
    cache = m.new_cache(3, 8)
    with pytest.raises(ValueError, match=r"query must have batch size 3 like the cache") as e:
        m(torch.randn(2, 1, 24), cache=cache)
    assert "positions" not in str(e.value)
    assert cache.lengths.tolist() == [0, 0, 0]
    plain = mha.MultiHeadAttention(24, 4)
    with pytest.raises(ValueError, match=r"query must have batch size 3 like the cache"):
        plain(torch.randn(2, 1, 24), cache=plain.new_cache(3, 8))


def test_rotation_refuses_what_the_library_refuses():
    rot = Rotary(8)
    with pytest.raises(TypeError, match="x must be a dense"):
        rot.apply_rotary(torch.randn(1, 1, 2, 8).to_sparse())
    with pytest.raises(TypeError, match="x must be a floating tensor"):
        rot.apply_rotary(torch.ones(1, 1, 2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="x must have shape"):
        rot.apply_rotary(torch.randn(2, 8))
    with pytest.raises(ValueError, match="head dim d >= the rotary dim 8"):
        rot.apply_rotary(torch.randn(1, 1, 2, 6))


@pytest.mark.parametrize("shape", [(1, 1, 12, 64), (2, 7, 3, 24), (4, 300, 12, 64)])
def test_the_rolled_and_the_halves_rotation_agree_bitwise(monkeypatch, shape):
    """Small calls of halves rotate by one roll (``_ROLL_MAX``), larger ones add into each half:
    the same values, bitwise, either way (r = d and partial r < d)."""
    import mha.rope as rope_mod

    g = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=g)  # (B, T, H, d)
    for r in (shape[-1], shape[-1] - 8):
        rope = Rotary(r, theta=500.0)
        C, S = rope.angles(None, shape[0], shape[1], x.device)  # (1, T, r) each
        outs = []
        for limit in (0, 1 << 30):  # halves, then rolled
            monkeypatch.setattr(rope_mod, "_ROLL_MAX", limit)
            outs.append(rope.rotate_tokens(x, C, S))
        assert torch.equal(outs[0], outs[1])


def test_angles_take_a_device_by_name():
    """``Rotary.angles(..., device="cpu")`` with positions: the same angles as with
    ``torch.device("cpu")`` (a name compared unequal to the device and was refused as
    "positions must be on cpu like the inputs, got cpu")."""
    rope = Rotary(8)
    p = torch.tensor([[3, 0, 7, 2]])  # (1, T)
    by_name, by_device = rope.angles(p, 1, 4, "cpu"), rope.angles(p, 1, 4, torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(by_name, by_device, strict=True))
