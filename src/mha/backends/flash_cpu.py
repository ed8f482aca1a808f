"""Backend ``flash_cpu``: the native CPU flash-attention kernel (``mha/csrc/flash_attn.cpp``).

Shape legend: B batch, h heads, h_kv K/V heads, Tq/Tk lengths, d_k/d_v head dims.
A thin adapter: the capability table says what it serves; the kernel is built on first use
(:func:`mha.native.load`). Training runs the fused native backward, sliding windows included
(O(Tq window) work and memory); NaN / Inf follow the rule in :mod:`mha.native`. When the build
fails, one warning gives the reason, the backend rejects every call with that reason
(``mha.explain`` shows it) and dispatch falls back.
"""

from __future__ import annotations

import functools
import warnings

import torch

from mha.backends.base import ALL_MASK_KINDS, AttentionCall, Backend, Capabilities


@functools.cache
def _unavailable() -> str | None:
    from mha import _build, native

    try:
        native.load()
    except _build.BuildError as e:
        reason = f"native kernel unavailable ({e})"
        if not e.warned:  # a cache directory that cannot be used: _build warned once
            warnings.warn(f"mha: flash_cpu disabled, falling back to other backends: {reason}",
                          RuntimeWarning, stacklevel=2)
        return reason
    return None


def _forward(call: AttentionCall):
    from mha import native

    m = call.masks
    out, _ = native.flash_attention(call.q, call.k, call.v, causal=m.causal,
                                    key_lengths=m.key_lengths, mask=m.mask, scale=call.scale,
                                    window=m.window)
    return out, None  # (B, h, Tq, d_v)


BACKEND = Backend(
    name="flash_cpu",
    summary="native flash-attention kernel for the CPU (AVX-512 / AVX512_BF16), O(T d) memory",
    caps=Capabilities(devices=frozenset({"cpu"}),
                      dtypes=frozenset({torch.float32, torch.bfloat16}),
                      min_head_dim=16, max_head_dim=256, gqa=True, different_v_dim=True,
                      dropout=False, weights=False, grad=True, mask_kinds=ALL_MASK_KINDS),
    forward=_forward,
    unavailable=_unavailable,
)
