"""The native decode kernel (``csrc/decode/flash_decode.cpp``): a few queries against a long K/V cache.

Shape legend: B batch, h query heads, h_kv key/value heads (h_kv divides h), Tq query length
(1 … 16 is what the kernel is for), Tk key length, d_k / d_v head dims.

Three layers, as for every native op in mha:

1. the registered op ``torch.ops.mha.flash_decode`` (schema in C++, built on first use by
   :func:`mha.ops.build.load_extension` as the extension ``mha_decode``) and its ``register_fake`` twin;
2. autograd: none — decoding is inference. The op's Autograd kernel (C++, so it costs
   nothing per step) refuses inputs that require grad with a reason, rather than PyTorch's
   fallback, which would warn and return no gradient; the backend's capabilities say the
   same (``grad=False``), so dispatch sends training elsewhere;
3. the thin public function :func:`flash_decode`, which validates its arguments.

If the build fails, :func:`unavailable` returns the reason (and one warning is issued); the
``flash_decode`` backend then rejects every call with that reason and dispatch moves on.
"""

from __future__ import annotations

import functools
import math

import torch

from mha.checks import (
    check_alibi_slopes,
    check_bias,
    check_bool,
    check_key_lengths,
    check_mask,
    check_qkv,
    check_scalar,
    check_sinks,
    check_softcap,
)
from mha.ops import build

EXTENSION = "mha_decode"
SOURCES = ("decode/flash_decode.cpp",)
MAX_TQ = 16  # the kernel keeps every query row of a K/V group in flight; beyond this use prefill


def _register() -> None:
    """The fake (shape-only) twins of the ops."""
    for name in ("mha::flash_decode", "mha::flash_decode_portable"):
        torch.library.register_fake(name)(_fake)


@torch.compiler.assume_constant_result  # under torch.compile: once, at trace time
def unavailable() -> str | None:
    """Why the decode kernel cannot run here (its build failed: warned once), or None."""
    return build.load_extension(
        EXTENSION, SOURCES, register=_register,
        instead="backend flash_decode disabled, falling back to other backends")


@functools.cache
def bf16_qk() -> str:
    """The bf16 q.k this process runs where the AMX tiles fit (G = h / h_kv * Tq <= 16,
    d_k % 32 == 0, d_k <= 128): ``amx``, ``amx-emulated`` (software tiles, a
    ``MHA_AMX_EMULATE=1`` build), ``avx512bf16`` or ``fp32``; chosen once per process from the
    build, the OS and ``MHA_DECODE_BF16``. Raises RuntimeError when the kernel is unavailable,
    or naming the variable, its choices and why when ``MHA_DECODE_BF16`` names a q.k this build
    cannot run (as every bf16 call does)."""
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(f"flash_decode: {reason}")
    return build.ask(torch.ops.mha.flash_decode_bf16_qk)


@functools.cache
def amx_refused() -> str | None:
    """Why the AMX q.k compiled into this build does not run in this process (the OS refuses
    the tile state, or ``MHA_DECODE_BF16=avx512bf16``): bf16 q.k then runs on ``vdpbf16ps``.
    None when it runs or is not compiled in. Raises RuntimeError as :func:`bf16_qk` does."""
    bf16_qk()
    return build.ask(torch.ops.mha.flash_decode_amx) or None


def _fake(q, k, v, key_lengths, mask, scale, causal, softcap=None, sinks=None, bias=None,
          alibi_slopes=None, k_scale=None, v_scale=None, block_table=None):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: "flash_decode: q, k, v must be 4-D")
    torch._check(k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0,
                 lambda: "flash_decode: h must be a multiple of h_kv")
    B, h, Tq, _ = q.shape
    return q.new_empty(B, h, Tq, v.shape[3])  # (B, h, Tq, d_v)


def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_lengths=None,
                 mask: torch.Tensor | None = None, causal: bool = False,
                 scale: float | None = None, portable: bool = False,
                 softcap: float | None = None, sinks=None, bias=None,
                 alibi_slopes=None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` for a few queries against a long cache, on the CPU.

    Args:
        q: ``(B, h, Tq, d_k)`` float32 or bfloat16.
        k: ``(B, h_kv, Tk, d_k)``; may be a strided view (e.g. the first Tk positions of a
            :class:`mha.KVCache`) as long as its last dim is contiguous — it is not copied.
        v: ``(B, h_kv, Tk, d_v)``, same rule.
        key_lengths: ``(B,)`` integers, real keys per row; keys beyond are never read.
        mask: bool, broadcastable to ``(B, h, Tq, Tk)``, True = may attend.
        causal: bottom-right aligned (query ``i`` sees keys ``j <= i + Tk - Tq``)::

                Tq=2, Tk=5   1 1 1 1 0
                             1 1 1 1 1

        scale: None means ``1 / sqrt(d_k)``; else a finite number >= 0. ``causal`` and
            ``portable`` are bools. Checked as :func:`mha.attention` checks them.
        portable: run the portable C++ loops instead of the AVX-512 path (for tests).
        softcap: a float > 0: scores become ``softcap * tanh(s / softcap)``.
        sinks: ``(h,)`` float, one sink logit per query head (its ``exp`` joins each row's
            softmax denominator; it has no value).
        bias: float, broadcastable to ``(B, h, Tq, Tk)``; read in place through its strides
            (a broadcast dim is never expanded); converted to float32 first if it is not.
        alibi_slopes: ``(h,)`` or ``(B, h)`` float: scores lose ``slope * (i + Tk - Tq - j)``.
            The variants are those of :func:`mha.attention`, in the order of
            :mod:`mha.scores`, all computed inside the kernel in fp32.
        k_scale, v_scale: int8 K/V (both or neither): k and v are int8 (symmetric, e.g. from
            :func:`quantize_int8`) and these their float32 scales ``(B, h_kv, Tk)``, one per
            token and K/V head (``k = k_scale[..., None] * k_int8``); may be strided views.
            Dequantized inside the kernel's loops (nothing is materialized).
        block_table: paged K/V (:class:`mha.PagedKVCache`): int32 ``(B, max_pages)``; k, v
            (and the int8 scales) are then page pools ``(num_pages, h_kv, page_size, d)``
            (``(num_pages, h_kv, page_size)``), and row b's key j is slot ``j % page_size`` of
            page ``block_table[b, j // page_size]``, read in place by the kernel. The key
            length is ``Tk = max_pages * page_size`` (mask and bias broadcast to it);
            ``key_lengths`` give each row's length, and causal and ALiBi align to it: each
            row is its own sequence, query ``i`` of row b sees keys
            ``j <= i + key_lengths[b] - Tq``. Entries past a row's length are not read.

    Returns ``(B, h, Tq, d_v)`` in q's dtype. Rows with no visible key are zeros. NaN / Inf:
    a row depends on its query and the keys it may attend only, as IEEE arithmetic of the
    formula makes it (a NaN in the query or a NaN / Inf in a visible key row: the row NaN; a
    NaN in a visible value row: that column NaN); rows of keys it may not attend never reach it.
    Deterministic: the key splits are fixed-size, independent of the thread count.
    """
    if block_table is not None:
        Tk = _check_paged(q, k, v, block_table)
        int8 = k_scale is not None or v_scale is not None
        if int8:
            _check_int8_kv(q, k, v, k_scale, v_scale, pages=True)
        # the shapes, in the seeds' words: the logical (B, h_kv, Tk, d) that the pages hold
        check_qkv(q, _like(k, q.dtype if int8 else k.dtype, (q.shape[0], k.shape[1], Tk, k.shape[3])),
                  _like(v, q.dtype if int8 else v.dtype, (q.shape[0], v.shape[1], Tk, v.shape[3])))
    elif k_scale is not None or v_scale is not None:
        _check_int8_kv(q, k, v, k_scale, v_scale)
        check_qkv(q, _like(k, q.dtype), _like(v, q.dtype))  # the shapes, in the seeds' words
    else:
        check_qkv(q, k, v)
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"flash_decode: q, k, v must be float32 or bfloat16, got {q.dtype}")
    if q.device.type != "cpu":
        raise ValueError(f"flash_decode: q, k, v must be on the CPU, got {q.device}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError("flash_decode is inference-only (no backward pass); call it under "
                           "torch.no_grad() or use mha.attention for training")
    B, h, Tq, d_k = q.shape
    Tk = k.shape[2] if block_table is None else block_table.shape[1] * k.shape[2]
    kl = None if key_lengths is None else check_key_lengths(key_lengths, B, Tk, q.device)
    m = None if mask is None else check_mask(mask, B, h, Tq, Tk, q.device)
    causal, portable = check_bool("causal", causal), check_bool("portable", portable)
    scale = 1.0 / math.sqrt(d_k) if scale is None else check_scalar("scale", scale, low=0.0)
    if softcap is not None:
        softcap = check_softcap(softcap)
    if sinks is not None:
        sinks = check_sinks(sinks, h, q.device)
    if bias is not None:
        bias = check_bias(bias, B, h, Tq, Tk, q.device)  # a 4-D view, never expanded
    if alibi_slopes is not None:
        alibi_slopes = check_alibi_slopes(alibi_slopes, B, h, q.device)  # (1|B, h)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (sinks, bias, alibi_slopes)):
        raise RuntimeError("flash_decode is inference-only (no backward pass): sinks / bias / "
                           "alibi_slopes require grad; call it under torch.no_grad() or use "
                           "mha.attention")
    return call_op(q, k, v, key_lengths=kl, mask=m, causal=causal, scale=scale, portable=portable,
                   softcap=softcap, sinks=sinks, bias=bias, alibi_slopes=alibi_slopes,
                   k_scale=k_scale, v_scale=v_scale, block_table=block_table)


def _like(t: torch.Tensor, dtype: torch.dtype, shape=None) -> torch.Tensor:
    """A stand-in of ``t``'s shape (or ``shape``) in ``dtype`` (one element, broadcast)."""
    return torch.zeros((), dtype=dtype, device=t.device).expand(t.shape if shape is None else shape)


def _check_paged(q, k, v, block_table) -> int:
    """Paged K/V: the block table an int32 ``(B, max_pages)`` tensor, k and v 4-D page pools
    ``(num_pages, h_kv, page_size, d)`` of the same pages; returns ``Tk = max_pages * page_size``.
    (The entries a row reads are checked against the pool in the kernel's guard.)"""
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
        got = block_table.dtype if isinstance(block_table, torch.Tensor) else \
            type(block_table).__name__
        raise TypeError(f"flash_decode: block_table must be an int32 tensor (B, max_pages), "
                        f"got {got}")
    B = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 4 else "B"
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"flash_decode: block_table must have shape (B, max_pages) with B = {B}, "
                         f"got {tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"flash_decode: block_table must be on {q.device}, got "
                         f"{block_table.device}")
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[2] < 1:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"flash_decode: with block_table, {name} must be a page pool "
                             f"(num_pages, h_kv, page_size, d), got {got}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"flash_decode: the k and v pools must hold the same pages "
                         f"(num_pages, h_kv, page_size), got {tuple(k.shape)} and {tuple(v.shape)}")
    return block_table.shape[1] * k.shape[2]


def _check_int8_kv(q, k, v, k_scale, v_scale, *, pages: bool = False) -> None:
    """int8 K/V: k, v int8 tensors, and both scales float32 ``(B, h_kv, Tk)`` (paged:
    ``(num_pages, h_kv, page_size)``)."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int8:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"flash_decode: with k_scale / v_scale, {name} must be an int8 "
                            f"tensor (B, h_kv, Tk, d), got {got}")
    form = "(num_pages, h_kv, page_size)" if pages else "(B, h_kv, Tk)"
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        want = (k.shape[0], k.shape[1], k.shape[2]) if k.dim() == 4 else form
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_decode: {name} must be a float32 tensor {form} = "
                            f"{want} (int8 K/V needs both scales), got {type(t).__name__}")
        if t.dtype != torch.float32 or t.device != q.device:
            raise TypeError(f"flash_decode: {name} must be float32 on {q.device}, got {t.dtype} "
                            f"on {t.device}")
        if k.dim() != 4 or tuple(t.shape) != want:
            raise ValueError(f"flash_decode: {name} must have shape {form} = {want}, got "
                             f"{tuple(t.shape)}")


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of the last dim: ``x (..., d)`` float -> ``(x_int8 (..., d),
    scale (...) float32)`` with ``scale = absmax / 127`` and ``x_int8 = round(x / scale)``, so
    ``|x - scale * x_int8| <= scale / 2 = absmax / 254`` per element (a zero row: scale 0)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0  # (...)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # (...)
    xq = torch.round(xf / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)  # (..., d)
    return xq, scale


def _fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    """A variant tensor as the kernel reads it: float32. Broadcast dims (stride 0, e.g. an
    ``expand``ed bias) are narrowed to one element before the conversion and expanded back
    after it (a view), so only the stored elements are converted, never the broadcast."""
    if t is None or t.dtype == torch.float32:
        return t
    small = t
    for d in range(t.dim()):
        if t.stride(d) == 0 and t.shape[d] > 1:
            small = small.narrow(d, 0, 1)  # (.., 1, ..) on that dim
    return small.to(torch.float32).expand(t.shape)  # stride 0 again where it was


def call_op(q, k, v, *, key_lengths, mask, causal: bool, scale: float, portable: bool = False,
            softcap: float | None = None, sinks=None, bias=None, alibi_slopes=None,
            k_scale=None, v_scale=None, block_table=None):
    """The op itself, on arguments already validated (used by the backend adapter): bias a
    4-D view broadcastable to ``(B, h, Tq, Tk)``, alibi_slopes ``(1|B, h)``, sinks ``(h,)``."""
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    # The kernel needs a contiguous last dim on K/V; a cache view already has one (no copy).
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    op = torch.ops.mha.flash_decode_portable if portable else torch.ops.mha.flash_decode
    return op(q, k, v, key_lengths, mask, scale, causal, softcap, _fp32(sinks), _fp32(bias),
              _fp32(alibi_slopes), k_scale, v_scale, block_table)
