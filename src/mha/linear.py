"""The module's projections ``x W^T + b`` on mha's own fp32 tiles, forward and backward.

Shape legend: x ``(..., K)``, weight ``(N, K)`` (``nn.Linear`` layout), bias ``(N,)``; the result
is ``(..., N)``.

torch's fp32 matmul runs MKL's AVX2 path on AMD CPUs (about 40 % of the FMA peak of the Zen 5
cores mha is measured on), so for the seeds' module (B = 32, T = 20, d_model = 512, where the
four projections are ~98 % of the FLOPs) the projections, not attention, set the speed.
:func:`linear` runs them on the flash kernels' AVX-512 register tiles (``csrc/linear.cpp``,
extension ``mha_linear``) when it can, and is ``torch.nn.functional.linear`` otherwise:

* only float32 CPU tensors, with ``N % 16 == 0`` and ``K % 16 == 0``, at least ``SMALL``
  multiply-adds, and the native extension built with AVX-512;
* not while ``torch.compile`` traces (it would see a Python-side cache).

When a gradient is needed it runs under an autograd function whose backward is native too
(``grad_x = grad_out W``, ``grad_w = grad_out^T x`` on the same tiles, no transposes).

The weight is repacked once into 64-column panels of ``W^T`` (``(ceil(N / 64), K, 64)``) and the
packed copy is kept on the weight tensor (attribute ``_mha_packed``; on its base for a slice),
keyed by storage, shape and version counter, so an in-place update (``load_state_dict``, an
optimizer step) is seen at the next call.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mha import _build

NAME = "mha_linear"
SOURCES = ("linear.cpp",)
PANEL = 64  # output columns per packed panel (csrc/linear.cpp kPanel)
SMALL = 1 << 20  # M N K below this: F.linear (7 x 33 x 32 ran at 0.4x F.linear; 5 x 512 x 512
                 # at 3x)


@functools.cache
def load() -> str | None:
    """Build (or reuse) and load the extension. Returns the reason it is unavailable, or None
    (no warning: :func:`linear` then is ``F.linear``, which is always correct)."""
    try:
        _build.load(NAME, SOURCES)
    except _build.BuildError as e:
        return str(e)
    torch.library.register_fake("mha::linear_packed")(_fake)
    if not torch.ops.mha.linear_vectorized():
        return "the native projections need AVX-512 (this build has the portable loops only)"
    return None


def _fake(x, wp, bias, N):
    return x.new_empty((x.shape[0], N))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``(N, K)`` -> ``(ceil(N / 64), K, 64)``: W^T in 64-column panels, zero past N."""
    N, K = weight.shape
    P = -(-N // PANEL)
    w = F.pad(weight.detach(), (0, 0, 0, P * PANEL - N))  # (P * 64, K)
    return w.view(P, PANEL, K).transpose(1, 2).contiguous()  # (P, 64, K) -> (P, K, 64)


def _packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The packed copy, kept on the weight tensor itself, or on its base when it is a view (the
    module's W^Q, W^K, W^V are slices of one parameter): it lives and dies with the weight."""
    holder = weight if weight._base is None else weight._base
    cache = getattr(holder, "_mha_packed", None)
    if cache is None or cache[0] != (holder.data_ptr(), holder._version):
        cache = ((holder.data_ptr(), holder._version), {})  # a new version drops every entry
        holder._mha_packed = cache
    key = (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()))
    if key not in cache[1]:
        cache[1][key] = pack(weight)
    return cache[1][key]


def why_not_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """The reason :func:`linear` falls back to ``F.linear`` for these arguments, or None."""
    if torch.compiler.is_compiling():
        return "torch.compile is tracing"
    tensors = [t for t in (x, weight, bias) if t is not None]
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return "float32 CPU tensors only"
    if weight.dim() != 2 or weight.shape[0] % 16 or weight.shape[1] % 16 or \
            x.shape[-1] != weight.shape[1]:
        return "weight (N, K) with N % 16 == 0, K % 16 == 0 and x (..., K)"
    if x.numel() * weight.shape[0] < SMALL:
        return f"fewer than {SMALL} multiply-adds (the call's fixed cost would dominate)"
    return load()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x ``(..., K)``, weight ``(N, K)``, bias ``(N,)`` ->
    ``(..., N)``, on the native fp32 tiles when :func:`why_not_native` finds no reason."""
    if why_not_native(x, weight, bias) is not None:
        return F.linear(x, weight, bias)
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)  # (..., K) -> (M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, weight, bias)):
        out = _Linear.apply(x2, weight, bias)
    else:
        out = torch.ops.mha.linear_packed(x2, _packed_weight(weight), bias, weight.shape[0])
    return out.view(*lead, weight.shape[0])  # (M, N) -> (..., N)


class _Linear(torch.autograd.Function):
    """``x W^T + b`` with native gradients: grad_x = grad_out W, grad_w = grad_out^T x (the
    tiles read grad_out through its strides, so nothing is transposed), grad_b = sum of rows."""

    @staticmethod
    def forward(ctx, x2, weight, bias):  # x2 (M, K), weight (N, K), bias (N,) or None
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mha.linear_packed(x2, _packed_weight(weight), bias, weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):  # grad_out (M, N)
        x2, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        gx, gw = torch.ops.mha.linear_backward(grad_out, x2, weight, need_x, need_w)
        gb = grad_out.sum(0) if ctx.has_bias and need_b else None  # (M, N) -> (N,)
        return (gx if need_x else None), (gw if need_w else None), gb


def linear_module(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` through :func:`linear`."""
    return linear(x, layer.weight, layer.bias)
