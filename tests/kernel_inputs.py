"""Inputs for the native-kernel tests, built one way for all of them: q/k/v in the layouts the
kernels must read through strides, and bool masks of every broadcast kind (True = may attend).

Shape legend: B batch, h / h_kv heads, Tq / Tk lengths, d_k / d_v head dims.
"""

from __future__ import annotations

import torch

LAYOUTS = ("bthd", "contiguous", "strided")


def layout_tensor(B: int, H: int, T: int, d: int, dtype, layout: str, g: torch.Generator):
    """``(B, H, T, d)`` as a view of the module's ``(B, T, H, d)`` ("bthd"), with a last-dim
    stride of 2 ("strided"), or contiguous."""
    if layout == "bthd":
        return torch.randn(B, T, H, d, generator=g).to(dtype).transpose(1, 2)  # (B, H, T, d)
    if layout == "strided":
        return torch.randn(B, H, T, 2 * d, generator=g).to(dtype)[..., ::2]  # (B, H, T, d)
    return torch.randn(B, H, T, d, generator=g).to(dtype)


def qkv(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, layout="bthd", seed=0, g=None):
    """q ``(B, h, Tq, d_k)``, k ``(B, h_kv, Tk, d_k)``, v ``(B, h_kv, Tk, d_v)``."""
    g = torch.Generator().manual_seed(seed) if g is None else g
    return (layout_tensor(B, h, Tq, d_k, dtype, layout, g),
            layout_tensor(B, h_kv, Tk, d_k, dtype, layout, g),
            layout_tensor(B, h_kv, Tk, d_v, dtype, layout, g))


def bool_mask(kind, B, h, Tq, Tk, seed):
    """None, or a bool mask broadcastable to ``(B, h, Tq, Tk)`` of the given kind."""
    g = torch.Generator().manual_seed(seed)
    if kind == "full":  # (B, h, Tq, Tk)
        return torch.rand(B, h, Tq, Tk, generator=g) > 0.3
    if kind == "rows":  # (1, 1, Tq, Tk)
        return torch.rand(1, 1, Tq, Tk, generator=g) > 0.5
    if kind == "keys":  # (B, 1, 1, Tk) expanded with stride-0 dims, not copied
        return (torch.rand(B, 1, 1, Tk, generator=g) > 0.2).expand(B, h, Tq, Tk)
    if kind == "queries":  # (B, 1, Tq, 1): whole query rows masked, broadcast over keys
        return torch.rand(B, 1, Tq, 1, generator=g) > 0.3
    if kind is None:
        return None
    raise ValueError(f"unknown mask kind {kind!r}")


def key_lengths(B: int, Tk: int, seed: int, on: bool = True):
    """``(B,)`` random lengths in ``[0, Tk]``, or None when ``on`` is False."""
    return torch.randint(0, Tk + 1, (B,), generator=torch.Generator().manual_seed(seed)) \
        if on else None
