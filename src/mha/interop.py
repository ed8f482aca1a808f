"""Conversion to and from ``torch.nn.MultiheadAttention`` (both of its weight layouts).

torch packs ``[W^Q; W^K; W^V]`` into ``in_proj_weight`` when kdim == vdim == embed_dim, and
keeps ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` otherwise. Both store weights in
nn.Linear layout ``(out_features, in_features)``, like mha. torch's masks use the opposite
polarity (True = masked); mha's are True = may attend.

This module does not import :mod:`mha.module`: :meth:`mha.MultiHeadAttention.from_torch` passes
its class in, and :func:`to_torch` reads only the module's sizes and weights.
"""

from __future__ import annotations

import torch
from torch import nn


def from_torch(m: nn.MultiheadAttention, cls: type[nn.Module]) -> nn.Module:
    """A ``cls`` (:class:`mha.MultiHeadAttention` or a subclass) with the weights of ``m``
    (which may be batch_first or not)."""
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"from_torch expects torch.nn.MultiheadAttention, got {type(m).__name__}")
    unsupported = [name for name, on in (("add_bias_kv", m.bias_k is not None),
                                          ("add_zero_attn", m.add_zero_attn)) if on]
    if unsupported:
        raise ValueError(f"from_torch: the module has {' and '.join(unsupported)}=True, which "
                         f"mha.MultiHeadAttention has no equivalent of (an extra learned or zero "
                         f"key/value appended to every sequence)")
    # torch's forward takes in_proj_bias and out_proj.bias independently (either may be None);
    # mha's biases are all or none, so a missing one becomes zeros: the same function
    in_bias, out_bias = m.in_proj_bias, m.out_proj.bias
    ref = m.out_proj.weight
    out = cls(m.embed_dim, m.num_heads, kdim=m.kdim, vdim=m.vdim,
              bias=in_bias is not None or out_bias is not None, dropout=m.dropout,
              device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        if m._qkv_same_embed_dim:
            E = m.embed_dim
            sources = [m.in_proj_weight[i * E:(i + 1) * E] for i in range(3)]  # 3 x (E, E)
        else:
            sources = [m.q_proj_weight, m.k_proj_weight, m.v_proj_weight]  # (E, E|kdim|vdim)
        E = m.embed_dim
        for i, ((w, b), src) in enumerate(zip(out.projection_weights(), sources, strict=True)):
            w.copy_(src)
            if b is not None:
                b.copy_(in_bias[i * E:(i + 1) * E]) if in_bias is not None else b.zero_()
        out.out_proj.weight.copy_(m.out_proj.weight)
        if out.out_proj.bias is not None:
            out.out_proj.bias.copy_(out_bias) if out_bias is not None else out.out_proj.bias.zero_()
    return out.train(m.training)


def to_torch(m: nn.Module) -> nn.MultiheadAttention:
    """A ``nn.MultiheadAttention(batch_first=True)`` with the weights of ``m`` (an
    :class:`mha.MultiHeadAttention`)."""
    if (m.num_kv_heads != m.num_heads or m.head_dim * m.num_heads != m.d_model
            or m.v_head_dim != m.head_dim):
        raise ValueError("to_torch: torch.nn.MultiheadAttention needs num_kv_heads == num_heads "
                         "and head_dim == v_head_dim == d_model / num_heads; got "
                         f"num_heads={m.num_heads}, num_kv_heads={m.num_kv_heads}, "
                         f"head_dim={m.head_dim}, v_head_dim={m.v_head_dim}, d_model={m.d_model}")
    ref = m.out_proj.weight
    projections = m.projection_weights()  # ((W^Q, b^Q), (W^K, b^K), (W^V, b^V))
    # a projection without its bias (removed from a module built with bias=True) is one with
    # zeros; torch's module has the in-projection biases and W_O's, each all or none
    bias = m.out_proj.bias is not None or any(b is not None for _, b in projections)
    t = nn.MultiheadAttention(m.d_model, m.num_heads, dropout=m.dropout, bias=bias,
                              kdim=m.kdim, vdim=m.vdim, batch_first=True, device=ref.device,
                              dtype=ref.dtype)
    with torch.no_grad():
        (wq, bq), (wk, bk), (wv, bv) = ((w, w.new_zeros(w.shape[0]) if b is None else b)
                                        for w, b in projections)
        if t._qkv_same_embed_dim:
            t.in_proj_weight.copy_(torch.cat([wq, wk, wv], dim=0))  # (3*d_model, d_model)
        else:
            t.q_proj_weight.copy_(wq)
            t.k_proj_weight.copy_(wk)
            t.v_proj_weight.copy_(wv)
        if t.in_proj_bias is not None:
            t.in_proj_bias.copy_(torch.cat([bq, bk, bv]))
        t.out_proj.weight.copy_(m.out_proj.weight)
        if t.out_proj.bias is not None:
            if m.out_proj.bias is None:
                t.out_proj.bias.zero_()
            else:
                t.out_proj.bias.copy_(m.out_proj.bias)
    return t.train(m.training)
