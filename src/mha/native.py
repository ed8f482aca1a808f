"""The native flash-attention kernel: its registered op, fake twin, autograd, and a thin function.

Shape legend: B batch, h query heads, h_kv key/value heads (h_kv divides h, g = h // h_kv),
Tq query length, Tk key length, d_k query/key head dim, d_v value head dim.

Three layers, as in flash-attention's interface:

1. ``torch.ops.mha.flash_attention_fwd`` — C++ (``csrc/flash_attn.cpp``), built on first use
   by :func:`mha._build.load` and cached; its ``register_fake`` twin below only allocates
   shaped outputs, so ``torch.compile`` and ``torch.library.opcheck`` work.
2. ``register_autograd``: the backward is ``mha::flash_attention_bwd``, a custom op that runs
   the fused native kernel (``csrc/flash_attn_bwd.cpp``, extension ``mha_flash_bwd``) or, if
   that cannot be built, :func:`flash_attention_bwd_torch`; both recompute the softmax weights
   from the saved log-sum-exp (never the whole ``(Tq, Tk)`` matrix for long sequences).
3. :func:`flash_attention` — the typed public function.
"""

from __future__ import annotations

import functools
import math

import torch

from mha import _build

NAME = "mha_flash"
SOURCES = ("flash_attn.cpp",)
_CHUNK_ELEMENTS = 1 << 20  # fp32 elements of one (B, h, rows, Tk) score chunk, PyTorch backward


@torch.compiler.assume_constant_result  # under torch.compile: once, at trace time
def load() -> str:
    """Build (or reuse) and load the extension, then register its Python side. Returns the
    library path; raises :class:`mha._build.BuildError` with the reason when it cannot."""
    return _load()


@functools.cache
def _load() -> str:
    lib = _build.load(NAME, SOURCES)
    torch.library.register_fake("mha::flash_attention_fwd")(_fwd_fake)
    torch.library.register_autograd("mha::flash_attention_fwd", _backward,
                                    setup_context=_setup_context)
    return str(lib)


def isa() -> str:
    """The instruction sets compiled into the kernel, e.g. ``portable,avx512f,avx512bf16``."""
    load()
    return torch.ops.mha.flash_attention_isa()


def kernels() -> dict[str, str]:
    """The tile kernel each dtype runs on this CPU, e.g. ``{"float32": "avx512f", ...}``."""
    load()
    f32, bf16 = torch.ops.mha.flash_attention_kernels()
    return {"float32": f32, "bfloat16": bf16}


def _fwd_fake(q, k, v, key_lengths, mask, causal, scale, window=0):
    B, h, Tq, _ = q.shape
    torch._check(k.shape[0] == B and v.shape[0] == B, lambda: "q, k, v must share B")
    torch._check(k.shape[3] == q.shape[3], lambda: "k must have d_k like q")
    torch._check(h % k.shape[1] == 0, lambda: "h_kv must divide h")
    out = q.new_empty((B, Tq, h, v.shape[3])).permute(0, 2, 1, 3)  # (B, h, Tq, d_v)
    lse = q.new_empty((B, h, Tq), dtype=torch.float32)  # (B, h, Tq)
    return out, lse


def _setup_context(ctx, inputs, output):
    q, k, v, key_lengths, mask, causal, scale, window = inputs
    if window > 0:  # the backward below does not apply the window
        raise NotImplementedError("flash_attention: a sliding window has no native backward yet")
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_lengths, mask)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, key_lengths, mask = ctx.saved_tensors
    dq, dk, dv = torch.ops.mha.flash_attention_bwd(grad_out, grad_lse, q, k, v, out, lse,
                                                   key_lengths, mask, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None, None, None


def _allowed_chunk(i0: int, i1: int, jmax: int, Tq: int, Tk: int, causal: bool,
                   key_lengths: torch.Tensor | None, mask: torch.Tensor | None):
    """The mask (True = may attend) of query rows [i0, i1) and keys [0, jmax), broadcastable to
    ``(B, h, i1 - i0, jmax)``; None when nothing is masked."""
    allowed = None
    if causal:
        i = torch.arange(i0, i1).unsqueeze(1)  # (C, 1)
        j = torch.arange(jmax).unsqueeze(0)  # (1, jmax)
        allowed = (j <= i + (Tk - Tq))[None, None]  # (1, 1, C, jmax)
    if key_lengths is not None:
        j = torch.arange(jmax)  # (jmax,)
        lm = (j < key_lengths.unsqueeze(1))[:, None, None, :]  # (B, 1, 1, jmax)
        allowed = lm if allowed is None else allowed & lm
    if mask is not None:
        m = mask if mask.shape[2] == 1 else mask[:, :, i0:i1]  # (B|1, h|1, C|1, Tk|1)
        m = m if m.shape[3] == 1 else m[..., :jmax]  # (B|1, h|1, C|1, jmax|1)
        allowed = m if allowed is None else allowed & m
    return allowed


BWD_NAME = "mha_flash_bwd"
BWD_SOURCES = ("flash_attn_bwd.cpp",)


@functools.cache
def load_backward() -> str | None:
    """Build (or reuse) and load the fused backward ``csrc/flash_attn_bwd.cpp`` (extension
    ``mha_flash_bwd``). Returns the reason it is unavailable (warned once), or None."""
    try:
        _build.load(BWD_NAME, BWD_SOURCES)
    except _build.BuildError as e:
        import warnings

        if not e.warned:  # a cache directory that cannot be used: _build warned once
            warnings.warn(f"mha: fused flash backward unavailable ({e}); using the PyTorch "
                          "backward", RuntimeWarning, stacklevel=3)
        return str(e)
    torch.library.register_fake("mha::flash_attention_bwd_fused")(_bwd_fake)
    return None


@torch.library.custom_op("mha::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None,
                        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, key_lengths: torch.Tensor | None,
                        mask: torch.Tensor | None, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`flash_attention`, in fp32 arithmetic: the fused
    native kernel ``mha::flash_attention_bwd_fused`` when it builds, else
    :func:`flash_attention_bwd_torch`."""
    if load_backward() is None:
        return torch.ops.mha.flash_attention_bwd_fused(grad_out, grad_lse, q, k, v, out, lse,
                                                       key_lengths, mask, causal, scale)
    return flash_attention_bwd_torch(grad_out, grad_lse, q, k, v, out, lse, key_lengths, mask,
                                     causal, scale)


def flash_attention_bwd_torch(grad_out, grad_lse, q, k, v, out, lse, key_lengths, mask,
                              causal: bool, scale: float):
    """The backward in PyTorch ops (fallback and test oracle): recomputes
    ``P = exp(S - lse)`` for chunks of query rows (keys past the causal diagonal skipped)."""
    B, h, Tq, d_k = q.shape
    h_kv, Tk, d_v = k.shape[1], k.shape[2], v.shape[3]
    g = h // h_kv
    f32 = torch.float32
    dq = torch.zeros(B, h, Tq, d_k, dtype=f32)
    dk = torch.zeros(B, h_kv, Tk, d_k, dtype=f32)
    dv = torch.zeros(B, h_kv, Tk, d_v, dtype=f32)
    if grad_out is None and grad_lse is None:
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    d_out = torch.zeros(B, h, Tq, d_v, dtype=f32) if grad_out is None else grad_out.to(f32)
    delta = (d_out * out.to(f32)).sum(-1)  # (B, h, Tq)
    if grad_lse is not None:
        delta = delta - grad_lse.to(f32)  # dS = P * (dP - delta + dlse)
    lse_safe = lse.masked_fill(lse == float("-inf"), float("inf"))  # empty rows: P = 0
    kf, vf = k.to(f32), v.to(f32)  # (B, h_kv, Tk, d_k), (B, h_kv, Tk, d_v)
    rows = max(1, min(Tq, _CHUNK_ELEMENTS // max(1, B * h * Tk)))
    for i0 in range(0, Tq, rows):
        i1 = min(Tq, i0 + rows)
        C = i1 - i0
        jmax = min(Tk, i1 + Tk - Tq) if causal else Tk  # last key any row of the chunk sees
        if jmax <= 0:
            continue
        q_c = q[:, :, i0:i1].to(f32).reshape(B, h_kv, g * C, d_k)  # (B, h_kv, g*C, d_k)
        do_c = d_out[:, :, i0:i1].reshape(B, h_kv, g * C, d_v)  # (B, h_kv, g*C, d_v)
        k_c, v_c = kf[:, :, :jmax], vf[:, :, :jmax]  # (B, h_kv, jmax, d_k|d_v)
        s = (q_c @ k_c.transpose(-2, -1)).view(B, h, C, jmax) * scale  # (B, h, C, jmax)
        p = torch.exp(s - lse_safe[:, :, i0:i1, None])  # (B, h, C, jmax)
        allowed = _allowed_chunk(i0, i1, jmax, Tq, Tk, causal, key_lengths, mask)
        if allowed is not None:
            p = p.masked_fill(~allowed, 0.0)
        p_g = p.view(B, h_kv, g * C, jmax)  # (B, h, C, jmax) -> (B, h_kv, g*C, jmax)
        dv[:, :, :jmax] += p_g.transpose(-2, -1) @ do_c  # (B, h_kv, jmax, d_v)
        dp = (do_c @ v_c.transpose(-2, -1)).view(B, h, C, jmax)  # (B, h, C, jmax)
        ds = (p * (dp - delta[:, :, i0:i1, None])).view(B, h_kv, g * C, jmax)
        dq[:, :, i0:i1] = (ds @ k_c).view(B, h, C, d_k) * scale  # (B, h, C, d_k)
        dk[:, :, :jmax] += (ds.transpose(-2, -1) @ q_c) * scale  # (B, h_kv, jmax, d_k)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@flash_attention_bwd.register_fake
def _bwd_fake(grad_out, grad_lse, q, k, v, out, lse, key_lengths, mask, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    key_lengths: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                    scale: float | None = None,
                    window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T * scale) v`` on the CPU with the native kernel, and its log-sum-exp.

    Args:
        q: ``(B, h, Tq, d_k)``, float32 or bfloat16, any strides.
        k: ``(B, h_kv, Tk, d_k)``; query head ``i`` reads K/V head ``i // (h // h_kv)``.
        v: ``(B, h_kv, Tk, d_v)``.
        causal: query ``i`` sees keys ``j <= i + Tk - Tq`` (bottom-right). For Tq=2, Tk=5::

                1 1 1 1 0
                1 1 1 1 1

        key_lengths: ``(B,)`` integers; keys ``j >= key_lengths[b]`` are padding.
        mask: bool broadcastable to ``(B, h, Tq, Tk)``, True = may attend; read in place
            through its strides (broadcast dims are not expanded).
        scale: multiplies the scores; None means ``1 / sqrt(d_k)``.
        window: sliding window (use with ``causal``): query ``i`` sees only keys
            ``j > i + Tk - Tq - window``; key blocks left of it are skipped. None: no window.
            Forward only: with inputs that require grad it raises ``NotImplementedError``.

    Returns:
        ``out (B, h, Tq, d_v)`` in q's dtype (memory laid out as ``(B, Tq, h, d_v)``) and
        ``lse (B, h, Tq)`` float32, ``log sum_j exp(s_ij)`` over visible keys. Query rows that
        see no key give zeros and ``lse = -inf`` (and zero, finite gradients).
    """
    load()
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B|1, h|1, Tq|1, Tk|1)
    if key_lengths is not None:
        key_lengths = torch.as_tensor(key_lengths).to(torch.int64)  # (B,)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
        raise ValueError(f"flash_attention: window must be a positive int or None, got {window!r}")
    args = (q, k, v, key_lengths, mask, bool(causal), scale, int(window or 0))
    if not torch.compiler.is_compiling() and not (
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        # no graph to record: skip the Python autograd wrapper (~6 us a call, measured on the
        # seeds' tiny shape where a whole call is ~400 us); it would redispatch the same way
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.mha.flash_attention_fwd(*args)
    return torch.ops.mha.flash_attention_fwd(*args)
