"""A small decoder-only transformer built from :class:`mha.MultiHeadAttention`, with greedy
generation through a K/V cache (seed 002: token t attends tokens 1..t).

Shape legend: B batch, T tokens in one call, T0 prompt length, N new tokens, V vocabulary,
d_model model width, h / h_kv query / key-value heads.

Pre-norm blocks ``x + MHA(LN(x), causal)``, ``x + MLP(LN(x))``; learned token and position
embeddings; a final LayerNorm and a linear LM head. Weights are random (seeded), never
downloaded: the model exists to exercise and measure decoding, not to write prose.
"""

from __future__ import annotations

import torch
from torch import nn

from mha.cache import ConcatKVCache, KVCache
from mha.checks import check_device, check_float_dtype
from mha.module import MultiHeadAttention

CACHE_KINDS = ("mha", "concat", None)


class DecoderBlock(nn.Module):
    """``x + MHA(LN(x))`` (causal), then ``x + MLP(LN(x))``; ``(B, T, d_model)`` in and out."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int | None, mlp_ratio: int,
                 **kw) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, **kw)
        self.attn = MultiHeadAttention(d_model, num_heads, num_kv_heads=num_kv_heads, **kw)
        self.ln2 = nn.LayerNorm(d_model, **kw)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model, **kw), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model, **kw))

    def forward(self, x: torch.Tensor, *, cache=None, backend: str | None = None
                ) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), causal=True, cache=cache, backend=backend)  # (B, T, d_model)
        return x + self.mlp(self.ln2(x))  # (B, T, d_model)


class TinyDecoder(nn.Module):
    """Token ids ``(B, T)`` -> next-token logits ``(B, T, V)``.

    Args:
        vocab_size: V.
        d_model, n_layers, num_heads: width, depth, query heads.
        num_kv_heads: h_kv (GQA; 1 = MQA). Default num_heads.
        max_len: the longest sequence (position embeddings).
        mlp_ratio: MLP hidden width / d_model.
        seed: initializes the weights reproducibly without touching the global RNG; None
            draws them from the global RNG instead.
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, num_heads: int, *,
                 num_kv_heads: int | None = None, max_len: int = 1024, mlp_ratio: int = 4,
                 seed: int | None = 0, device=None, dtype=None) -> None:
        super().__init__()
        for name, val in (("vocab_size", vocab_size), ("n_layers", n_layers),
                          ("max_len", max_len), ("mlp_ratio", mlp_ratio)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        kw = dict(device=check_device("device", device),
                  dtype=check_float_dtype("dtype", dtype))
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            self.tok = nn.Embedding(vocab_size, d_model, **kw)
            self.pos = nn.Embedding(max_len, d_model, **kw)
            self.blocks = nn.ModuleList(DecoderBlock(d_model, num_heads, num_kv_heads, mlp_ratio,
                                                     **kw) for _ in range(n_layers))
            self.ln_f = nn.LayerNorm(d_model, **kw)
            self.lm_head = nn.Linear(d_model, vocab_size, bias=False, **kw)
        self.vocab_size, self.max_len = vocab_size, max_len

    def new_caches(self, batch_size: int, max_len: int | None = None) -> list[KVCache]:
        """One empty :class:`mha.KVCache` per layer, ``max_len`` (default the model's) long."""
        n = self.max_len if max_len is None else max_len
        return [b.attn.new_cache(batch_size, n) for b in self.blocks]

    def forward(self, idx: torch.Tensor, *, caches: list | None = None,
                backend: str | None = None) -> torch.Tensor:
        """``idx (B, T)`` -> logits ``(B, T, V)``. With ``caches`` (one per layer), ``idx`` holds
        only the new tokens; their positions continue each row's cache. ``backend`` forces one
        attention backend for every layer (None: dispatch chooses)."""
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype.is_floating_point:
            got = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"idx must be an integer tensor of shape (B, T), got {got}")
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(f"caches: expected one per layer ({len(self.blocks)}), "
                             f"got {len(caches)}")
        B, T = idx.shape
        if caches is None:  # checked on the shape alone (no data-dependent branch to trace)
            if T > self.max_len:
                raise ValueError(f"positions up to {T - 1} exceed max_len={self.max_len}")
            pos = torch.arange(T, device=idx.device).unsqueeze(0)  # (1, T)
        else:
            pos = caches[0].positions(T).to(idx.device)  # (B, T) or (1, T)
            if T and int(pos.max()) >= self.max_len:
                raise ValueError(f"positions up to {int(pos.max())} exceed max_len={self.max_len}")
        x = self.tok(idx) + self.pos(pos)  # (B, T, d_model)
        for i, block in enumerate(self.blocks):
            x = block(x, cache=None if caches is None else caches[i], backend=backend)
        return self.lm_head(self.ln_f(x))  # (B, T, d_model) @ W -> (B, T, V)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, cache: str | None = "mha",
                 backend: str | None = None) -> torch.Tensor:
        """Greedy decoding: ``idx (B, T0)`` -> ``(B, T0 + N)`` with N = ``max_new_tokens``.

        cache: ``"mha"`` — one preallocated :class:`mha.KVCache` per layer, written in place
        (prefill once, then one token per step); ``"concat"`` — the ``torch.cat``-growing
        baseline (same math, the history copied every step); ``None`` — no cache, the whole
        sequence recomputed every step. ``backend`` forces one attention backend throughout.
        """
        if cache not in CACHE_KINDS:
            raise ValueError(f"cache must be one of {CACHE_KINDS}, got {cache!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        B, T0 = idx.shape
        if T0 == 0:
            raise ValueError("idx must hold at least one prompt token per row, got shape "
                             f"{tuple(idx.shape)}")
        if T0 + max_new_tokens > self.max_len:
            raise ValueError(f"prompt length {T0} + max_new_tokens {max_new_tokens} exceeds "
                             f"max_len={self.max_len}")
        out = [idx]
        if max_new_tokens == 0:
            return idx
        if cache is None:
            seq = idx
            for _ in range(max_new_tokens):
                nxt = self(seq, backend=backend)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
                seq = torch.cat([seq, nxt], dim=1)  # (B, T + 1)
            return seq
        caches = (self.new_caches(B, T0 + max_new_tokens) if cache == "mha"
                  else [ConcatKVCache() for _ in self.blocks])
        nxt = self(idx, caches=caches, backend=backend)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        out.append(nxt)
        for _ in range(max_new_tokens - 1):
            nxt = self(nxt, caches=caches, backend=backend)[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
        return torch.cat(out, dim=1)  # (B, T0 + N)
