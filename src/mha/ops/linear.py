"""The module's projections ``x W^T + b`` on mha's own fp32 tiles, forward and backward.

Shape legend: x ``(..., K)``, weight ``(N, K)`` (``nn.Linear`` layout), bias ``(N,)``; the result
is ``(..., N)``.

torch's fp32 matmul runs MKL's AVX2 path on AMD CPUs (about 40 % of the FMA peak of the Zen 5
cores mha is measured on), so for the seeds' module (B = 32, T = 20, d_model = 512, where the
four projections are ~98 % of the FLOPs) the projections, not attention, set the speed.
:func:`linear` runs them on the flash kernels' AVX-512 register tiles (``csrc/linear/linear.cpp``,
extension ``mha_linear``) when it can, and is ``torch.nn.functional.linear`` otherwise:

* only float32 CPU tensors, with ``N % 16 == 0`` and ``K % 16 == 0``, at least ``SMALL``
  multiply-adds and ``ROWS`` rows of x, and the native extension built with AVX-512;
* not while ``torch.compile`` traces (the op has no autograd formula registered with
  ``torch.library`` for the compiler to trace; it gets ``F.linear``).

When a gradient is needed it runs under an autograd function whose backward is native too
(``grad_x = grad_out W``, ``grad_w = grad_out^T x`` on the same tiles, no transposes). With
``create_graph=True`` the backward is written with differentiable torch ops instead, so double
backward (a gradient penalty, Hessian-vector products) works.

Nothing derived from a weight is kept between calls: the native op packs ``W^T`` into 64-column
panels (``(ceil(N / 64), K, 64)``) inside every call, O(N K) against the GEMM's O(M N K). So a
weight changed by any route — an optimizer step, ``load_state_dict``, ``w.data.mul_(2)``,
``p.data = t``, writes through ``w.numpy()`` or ``w.untyped_storage()`` — is read as it is now.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mha.ops import build

NAME = "mha_linear"
SOURCES = ("linear/linear.cpp",)
SMALL = 1 << 20  # M N K below this: F.linear (7 x 33 x 32 ran at 0.4x F.linear; 5 x 512 x 512
                 # at 3x with the weight packed ahead of the call)
ROWS = 16  # M below this: F.linear, since each call packs W (O(N K)) for only M rows of GEMM
           # (8 x 512 x 1536 ran at 0.5x F.linear; benchmarks/probes/linear.py)


def load() -> str | None:
    """Build (or reuse) and load the extension. Returns the reason it is unavailable, or None
    (no warning: :func:`linear` then is ``F.linear``, which is always correct)."""
    reason = build.load_extension(NAME, SOURCES, register=_register)
    if reason is None and not _vectorized():
        return "the native projections need AVX-512 (this build has the portable loops only)"
    return reason


def _register() -> None:
    torch.library.register_fake("mha::linear")(_fake)


@functools.cache
def _vectorized() -> bool:
    return bool(torch.ops.mha.linear_vectorized())


def _fake(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))  # (M, K) x (N, K) -> (M, N)


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
    if x.numel() < ROWS * x.shape[-1]:
        return f"fewer than {ROWS} rows of x (packing the weight would dominate)"
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
        out = torch.ops.mha.linear(x2, weight, bias)
    return out.view(*lead, weight.shape[0])  # (M, N) -> (..., N)


class _Linear(torch.autograd.Function):
    """``x W^T + b`` with native gradients: grad_x = grad_out W, grad_w = grad_out^T x (the
    tiles read grad_out through its strides, so nothing is transposed), grad_b = sum of rows.
    Under ``create_graph=True`` (grad mode on inside backward) the same three products are torch
    ops, so the gradients are themselves differentiable."""

    @staticmethod
    def forward(ctx, x2, weight, bias):  # x2 (M, K), weight (N, K), bias (N,) or None
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mha.linear(x2, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # grad_out (M, N)
        x2, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        gb = grad_out.sum(0) if ctx.has_bias and need_b else None  # (M, N) -> (N,)
        if torch.is_grad_enabled():  # create_graph=True: differentiable products
            gx = grad_out @ weight if need_x else None  # (M, N) @ (N, K) -> (M, K)
            gw = grad_out.t() @ x2 if need_w else None  # (N, M) @ (M, K) -> (N, K)
            return gx, gw, gb
        gx, gw = torch.ops.mha.linear_backward(grad_out, x2, weight, need_x, need_w)
        return (gx if need_x else None), (gw if need_w else None), gb


def linear_module(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` through :func:`linear`."""
    return linear(x, layer.weight, layer.bias)
