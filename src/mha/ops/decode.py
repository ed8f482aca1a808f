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

import math

import torch

from mha.checks import check_key_lengths, check_mask, check_qkv
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


def _fake(q, k, v, key_lengths, mask, scale, causal):
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
                 alibi_slopes=None) -> torch.Tensor:
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

        scale: None means ``1 / sqrt(d_k)``.
        portable: run the portable C++ loops instead of the AVX-512 path (for tests).
        softcap, sinks, bias, alibi_slopes: the score variants of :func:`mha.attention`. The
            native kernel serves none of them yet: with any of them the call runs on the
            Python path (``mha.attention``'s dispatch, i.e. sdpa or math), same result contract.

    Returns ``(B, h, Tq, d_v)`` in q's dtype. Rows with no visible key are zeros. NaN / Inf:
    a row depends on its query and the keys it may attend only, as IEEE arithmetic of the
    formula makes it (a NaN in the query or a NaN / Inf in a visible key row: the row NaN; a
    NaN in a visible value row: that column NaN); rows of keys it may not attend never reach it.
    Deterministic: the key splits are fixed-size, independent of the thread count.
    """
    check_qkv(q, k, v)
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"flash_decode: q, k, v must be float32 or bfloat16, got {q.dtype}")
    if q.device.type != "cpu":
        raise ValueError(f"flash_decode: q, k, v must be on the CPU, got {q.device}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError("flash_decode is inference-only (no backward pass); call it under "
                           "torch.no_grad() or use mha.attention for training")
    if any(x is not None for x in (softcap, sinks, bias, alibi_slopes)):
        from mha.functional import attention  # validates every argument

        return attention(q, k, v, key_lengths=key_lengths, mask=mask, causal=causal,
                         scale=scale, softcap=softcap, sinks=sinks, bias=bias,
                         alibi_slopes=alibi_slopes)
    B, h, Tq, d_k = q.shape
    Tk = k.shape[2]
    kl = None if key_lengths is None else check_key_lengths(key_lengths, B, Tk, q.device)
    m = None if mask is None else check_mask(mask, B, h, Tq, Tk, q.device)
    scale = 1.0 / math.sqrt(d_k) if scale is None else float(scale)
    return call_op(q, k, v, key_lengths=kl, mask=m, causal=causal, scale=scale, portable=portable)


def call_op(q, k, v, *, key_lengths, mask, causal: bool, scale: float, portable: bool = False):
    """The op itself, on arguments already validated (used by the backend adapter)."""
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    # The kernel needs a contiguous last dim on K/V; a cache view already has one (no copy).
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    op = torch.ops.mha.flash_decode_portable if portable else torch.ops.mha.flash_decode
    return op(q, k, v, key_lengths, mask, scale, causal)
