"""``mha.models.TinyDecoder``: greedy generation with mha's cache equals the torch.cat baseline
and the no-cache recomputation, and mha's cache copies O(N d) bytes over N tokens, not O(N^2 d).

Shape legend: B batch, T0 prompt length, N new tokens, V vocabulary, d_model width.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mha.models import DecoderBlock, TinyDecoder

aten = torch.ops.aten


def _prompt(B, T0, V=97, seed=5):
    return torch.randint(0, V, (B, T0), generator=torch.Generator().manual_seed(seed))


def _model(dtype=torch.float32, num_kv_heads=None, max_len=160):
    return TinyDecoder(97, 64, 2, 4, num_kv_heads=num_kv_heads, max_len=max_len,
                       dtype=dtype).eval()


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
def test_greedy_generation_same_tokens_with_and_without_cache(num_kv_heads):
    m, idx = _model(num_kv_heads=num_kv_heads), _prompt(3, 6)
    with_cache = m.generate(idx, 24, cache="mha")
    assert with_cache.shape == (3, 30) and torch.equal(with_cache[:, :6], idx)
    assert torch.equal(with_cache, m.generate(idx, 24, cache="concat"))
    assert torch.equal(with_cache, m.generate(idx, 24, cache=None))


def test_bf16_generation_mha_cache_equals_the_concat_baseline():
    """Same math on the same kernels: the in-place cache and torch.cat give the same tokens.
    (Against the no-cache recomputation bf16 rounding may flip near-ties, so that is fp32's.)"""
    m, idx = _model(torch.bfloat16, num_kv_heads=2), _prompt(2, 5)
    assert torch.equal(m.generate(idx, 30, cache="mha"), m.generate(idx, 30, cache="concat"))


def test_seeded_init_is_reproducible_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b = TinyDecoder(50, 32, 1, 2, seed=3), TinyDecoder(50, 32, 1, 2, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    c = TinyDecoder(50, 32, 1, 2, seed=4)
    assert not torch.equal(a.tok.weight, c.tok.weight)


def test_the_experiment_model_draws_its_blocks_as_written_out_by_hand():
    """The experiments' TinyTransformer is built from DecoderBlock; seeded, it draws the same
    parameters, under the same names, in the same order as its layers written out by hand
    (token and position embeddings, then per block LN, MHA(d_model, h), LN, MLP, then LN and the
    read-out), so experiment results stay reproducible from their seeds."""
    import mha
    from mha.experiments.model import ModelConfig, TinyTransformer

    cfg = ModelConfig(d_model=32, num_heads=4, n_layers=2, n_inputs=11, n_classes=5,
                      max_len=16, n_slots=2, mlp_ratio=3)
    torch.manual_seed(7)
    model = TinyTransformer(cfg)
    assert all(isinstance(b, DecoderBlock) for b in model.blocks)
    torch.manual_seed(7)
    want = {"tok.weight": torch.nn.Embedding(11, 32).weight,
            "pos.weight": torch.nn.Embedding(16, 32).weight}
    for i in range(cfg.n_layers):
        parts = (("ln1", torch.nn.LayerNorm(32)), ("attn", mha.MultiHeadAttention(32, 4)),
                 ("ln2", torch.nn.LayerNorm(32)),
                 ("mlp", torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.GELU(),
                                             torch.nn.Linear(96, 32))))
        for part, module in parts:
            want |= {f"blocks.{i}.{part}.{k}": v for k, v in module.state_dict().items()}
    head = (("ln_f", torch.nn.LayerNorm(32)), ("head", torch.nn.Linear(32, 10)))
    want |= {f"{part}.{k}": v for part, module in head for k, v in module.state_dict().items()}
    got = model.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_generate_checks_its_arguments():
    m, idx = _model(max_len=16), _prompt(1, 6)
    with pytest.raises(ValueError, match="max_len=16"):
        m.generate(idx, 11)
    with pytest.raises(ValueError, match="cache must be one of"):
        m.generate(idx, 2, cache="paged")
    with pytest.raises(ValueError, match=r"idx must be an integer tensor of shape \(B, T\)"):
        m(torch.zeros(2, 3, 4))
    assert torch.equal(m.generate(idx, 0), idx)


class _CopyCounter(TorchDispatchMode):
    """Counts bytes produced by copying ops; and bytes written into given storages."""

    COPIES = {aten.cat, aten.copy_, aten.scatter_, aten.index_put_, aten.index_copy_,
              aten.slice_scatter, aten.clone, aten._to_copy}

    def __init__(self, storages=()):
        super().__init__()
        self.storages = {s.untyped_storage().data_ptr() for s in storages}
        self.copied = 0
        self.into_storages = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self.COPIES:
            t = out[0] if isinstance(out, (tuple, list)) else out
            dst = args[0] if func.overloadpacket in (aten.copy_, aten.scatter_) else t
            written = args[-1] if func.overloadpacket == aten.copy_ else (
                kwargs or {}).get("src", args[3] if len(args) > 3 else t)
            nbytes = written.numel() * written.element_size()
            self.copied += nbytes
            if dst.untyped_storage().data_ptr() in self.storages:
                self.into_storages += nbytes
        return out


def test_the_cache_writes_exactly_the_new_tokens_and_never_moves():
    m, idx = _model(num_kv_heads=2), _prompt(2, 7)
    T0, N = idx.shape[1], 25
    with torch.no_grad():
        caches = m.new_caches(2, T0 + N)
        ptrs = [(c.k.data_ptr(), c.v.data_ptr()) for c in caches]
        storages = [t for c in caches for t in (c.k, c.v)]
        with _CopyCounter(storages) as counter:
            nxt = m(idx, caches=caches)[:, -1:].argmax(-1)
            for _ in range(N - 1):
                nxt = m(nxt, caches=caches)[:, -1:].argmax(-1)
    per_token = 2 * 2 * (16 + 16) * 4  # B * h_kv * (d_k + d_v) * fp32 bytes, per layer
    assert counter.into_storages == (T0 + N - 1) * per_token * len(caches)
    assert [(c.k.data_ptr(), c.v.data_ptr()) for c in caches] == ptrs


def test_total_copying_grows_linearly_with_mha_cache_and_quadratically_with_concat():
    m, idx = _model(max_len=100), _prompt(1, 4)

    def copied(n, cache):
        with torch.no_grad(), _CopyCounter() as counter:
            m.generate(idx, n, cache=cache)
        return counter.copied

    mha_ratio = copied(80, "mha") / copied(40, "mha")
    concat_ratio = copied(80, "concat") / copied(40, "concat")
    assert mha_ratio < 2.2, f"mha cache: doubling N multiplied copied bytes by {mha_ratio:.2f}"
    assert concat_ratio > 3.0, f"concat: doubling N multiplied copied bytes by {concat_ratio:.2f}"
