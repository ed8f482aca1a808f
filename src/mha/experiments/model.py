"""A small causal transformer built from :class:`mha.MultiHeadAttention`.

Shape legend: B batch, T sequence length, d_model model width, h heads, d_k = d_model / h,
V input vocabulary, S targets ("slots") per position, C classes per slot.

Pre-norm blocks ``x + MHA(LN(x))``, ``x + MLP(LN(x))`` (:class:`mha.models.DecoderBlock`, the
block of the decoding model too); learned token and position embeddings;
a final LayerNorm and a linear read-out to S x C logits. The attention is always
``mha.MultiHeadAttention(d_model, h)`` called with ``causal=True``, and no backend is forced:
training runs through whichever backend mha's dispatch picks for a call that needs gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import mha
from mha.models.decoder import DecoderBlock


@dataclass(frozen=True)
class ModelConfig:
    """The width, depth and vocabulary of one model; ``num_heads`` is the swept variable."""

    d_model: int
    num_heads: int
    n_layers: int
    n_inputs: int  # V
    n_classes: int  # C
    max_len: int
    n_slots: int = 1  # S
    mlp_ratio: int = 4


class TinyTransformer(nn.Module):
    """``x (B, T)`` token ids -> logits ``(B, T, S, C)``; position t sees tokens 0..t."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.n_inputs, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(DecoderBlock(cfg.d_model, cfg.num_heads, None, cfg.mlp_ratio)
                                    for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.n_slots * cfg.n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape
        if T > self.cfg.max_len:
            raise ValueError(f"x must have shape (B, T) with T <= max_len={self.cfg.max_len}, "
                             f"got {tuple(x.shape)}")
        pos = torch.arange(T, device=x.device)  # (T,)
        h = self.tok(x) + self.pos(pos)  # (B, T, d_model)
        for block in self.blocks:
            h = block(h)  # (B, T, d_model)
        logits = self.head(self.ln_f(h))  # (B, T, d_model) @ W -> (B, T, S*C)
        return logits.view(B, T, self.cfg.n_slots, self.cfg.n_classes)  # (B, T, S, C)

    def attention_modules(self) -> list[mha.MultiHeadAttention]:
        return [b.attn for b in self.blocks]

    def param_counts(self) -> dict[str, int]:
        """Total parameters, and those of the attention layers (W_Q, W_K, W_V, W_O + biases:
        ``4 d_model^2 + 4 d_model`` per layer, whatever h is)."""
        total = sum(p.numel() for p in self.parameters())
        attn = sum(p.numel() for m in self.attention_modules() for p in m.parameters())
        return {"total": total, "attention": attn}


def served_by(model: TinyTransformer, batch: int, seq_len: int) -> str:
    """The backend mha's dispatch picks for this model's training-time attention call
    (q, k, v ``(B, h, T, d_k)`` needing gradients, causal), from :func:`mha.explain`."""
    cfg = model.cfg
    d_k = cfg.d_model // cfg.num_heads
    q = torch.zeros(batch, cfg.num_heads, seq_len, d_k, requires_grad=True)  # (B, h, T, d_k)
    with torch.enable_grad():
        verdicts = mha.explain(q, q, q, causal=True)
    return verdicts.chosen or "none"
