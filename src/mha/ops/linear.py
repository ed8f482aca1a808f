"""The module's projections ``x W^T + b`` on mha's own fp32 and bf16 tiles, forward and backward.

Shape legend: x ``(..., K)``, weight ``(N, K)`` (``nn.Linear`` layout), bias ``(N,)``; the result
is ``(..., N)``.

For the seeds' module (B = 32, T = 20, d_model = 512, where the four projections are ~98 % of
the FLOPs) the projections, not attention, set the speed, and which GEMM is faster depends on
the CPU: the flash kernels' register tiles (``csrc/linear/linear.cpp``, extension
``mha_linear``) beat MKL's AVX2 path on the AVX-512 EPYC, MKL's AVX-512 path beats them on the
Intel Xeon. :func:`linear` therefore runs on whichever was measured faster on this CPU for the
call's shape class (:mod:`mha.ops.linear_choice`: measured once per CPU model, cached beside
the built kernels; ``MHA_LINEAR=native|torch`` forces a side), and is
``torch.nn.functional.linear`` whenever the native op cannot take the call:

* only float32 and bfloat16 CPU tensors (other dtypes: torch's GEMM), with ``N % 16 == 0`` and
  ``K % 16 == 0``, at least ``SMALL`` multiply-adds (below that a measurement would time the
  call overhead, and F.linear's is the smaller), and the extension built. bfloat16 has its own
  measured choice (:func:`_bf16_side`): the native op's bf16 tiles (``vdpbf16ps``, fp32 sums,
  each output rounded once; where the build has AVX512_BF16) or, without them, fp32 on upcast
  inputs (then the fp32 choice applies), against torch's bf16 GEMM;
* not while ``torch.compile`` traces (the op has no autograd formula registered with
  ``torch.library`` for the compiler to trace; it gets ``F.linear``), nor within
  :func:`torch_gemm` (a graph for a runtime that knows no mha op: ``mha.export.onnx``). Under
  ``torch.export`` the op is recorded in the program (its fake twin gives the shapes); the
  rows are then a range, which has no shape class, so the choice is the one measured at
  ``linear_choice.MIN_ROWS`` rows, the tiles' speed (:func:`_exported_reason`).

:func:`describe` says in one sentence which GEMM a call gets and why (the measured ratio, the
shape and the CPU); :func:`why_not_native` is that sentence when it is not the native tiles.

When a gradient is needed it runs under an autograd function whose backward is native too
(``grad_x = grad_out W``, ``grad_w = grad_out^T x`` on the same tiles: no transposes in fp32;
the bf16 tiles copy ``W^T``, ``grad_out^T`` and ``x^T`` once, as their pairs run over the
summed dimension). With
``create_graph=True`` the backward is written with differentiable torch ops instead, so double
backward (a gradient penalty, Hessian-vector products) works.

Nothing derived from a weight is kept between calls: the native op packs ``W^T`` into 64-column
panels (``(ceil(N / 64), K, 64)``; bf16: ``(K / 2, 64, 2)`` pairs per panel, packed by the thread
that uses the panel) inside every call, O(N K) against the GEMM's O(M N K). So a
weight changed by any route — an optimizer step, ``load_state_dict``, ``w.data.mul_(2)``,
``p.data = t``, writes through ``w.numpy()`` or ``w.untyped_storage()`` — is read as it is now.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from mha.ops import build, forcing, linear_choice
from mha.symbolic import size_below

NAME = "mha_linear"
SOURCES = ("linear/linear.cpp", "linear/self_attention.cpp")
SMALL = 1 << 20  # M N K below this: F.linear without measuring (7 x 33 x 32 ran at 0.4x
                 # F.linear: the call's fixed cost, not the GEMM, decides there)


def load() -> str | None:
    """Build (or reuse) and load the extension. Returns the reason it is unavailable, or None
    (no warning: :func:`linear` then is ``F.linear``, which is always correct). Where the CPU
    lacks AVX-512 the extension has its portable loops; the measurement decides whether they
    are worth calling."""
    return build.load_extension(NAME, SOURCES, register=_register)


@functools.cache
def kernel() -> str:
    """The native build's cache key (sources, flags, toolchain, CPU): a new build is measured
    again. Only after :func:`load` returned None."""
    return build.load(NAME, SOURCES).parent.name


def _register() -> None:
    torch.library.register_fake("mha::linear")(_fake)
    torch.library.register_fake("mha::linear_backward")(_backward_fake)
    torch.library.register_fake("mha::self_attention_f32")(_self_attention_fake)
    if build.ask(torch.ops.mha.linear_bf16_tiles):
        torch.library.register_fake("mha::linear_bf16")(_fake)
        torch.library.register_fake("mha::linear_bf16_backward")(_backward_fake)
        torch.library.register_fake("mha::self_attention_bf16")(_self_attention_fake)


def _fake(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))  # (M, K) x (N, K) -> (M, N)


def _self_attention_fake(x, w_qkv, b_qkv, w_o, b_o, heads, scale, w_qkv_panels=None,
                         w_o_panels=None, causal=False, rope_cos=None, rope_sin=None,
                         rope_interleaved=False):
    """The fused forward's (:mod:`mha.ops.self_attention`, built into this extension) fake:
    only the output's shape, ``(B, T, D) -> (B, T, N_out)``."""
    return x.new_empty((x.shape[0], x.shape[1], w_o.shape[0]))  # (B, T, N_out)


def _backward_fake(grad_out, x, weight, need_x, need_w):
    """``(grad_x (M, K), grad_w (N, K))``, both shaped (the op leaves an unneeded one undefined,
    which a fake cannot; the autograd function reads only the needed ones). Traced when strict
    torch.export speculates the autograd function's backward."""
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


_torch_gemm_only = False  # set by torch_gemm() (a plain global: torch.compile reads it)


@contextlib.contextmanager
def torch_gemm():
    """Within the block every projection is ``F.linear`` (torch's GEMM), whatever was
    measured: for a graph that another runtime runs (``mha.export.onnx``), which knows no mha
    op. Process-wide while the block runs (blocks nest)."""
    global _torch_gemm_only
    outer, _torch_gemm_only = _torch_gemm_only, True
    try:
        yield
    finally:
        _torch_gemm_only = outer


def _traced_reason() -> str | None:
    """Why this call takes ``F.linear`` whatever was measured, or None."""
    if _torch_gemm_only:
        return "a graph for another runtime is being traced (mha.export.onnx)"
    if torch.compiler.is_compiling() and not torch.compiler.is_exporting():
        return "torch.compile is tracing"
    return None


def _small(x: torch.Tensor, N: int) -> bool:
    """Fewer than ``SMALL`` multiply-adds (a range under torch.export: small only if all are)."""
    return size_below(x.numel() * N, SMALL, unsettled=False)


def why_not_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why :func:`linear` runs ``F.linear`` (torch's GEMM) for these arguments, or None when it
    runs native tiles (bfloat16: the bf16 tiles, or the fp32 tiles on upcast inputs). The first
    call of a shape class on a machine may measure both (see :mod:`mha.ops.linear_choice`);
    later ones read the answer."""
    traced = _traced_reason()
    if traced is not None:
        return traced
    bf16 = _bf16_side(x, weight, bias)
    if bf16 is not None:
        side, why = bf16
        if side != "upcast":
            return None if side == "tiles" else why
        if torch.compiler.is_exporting():  # the fp32 choice (its shape checks: the bf16 ones)
            return _exported_reason(*weight.shape)
        M, K = x.numel() // x.shape[-1], x.shape[-1]
        x32 = torch.empty(()).expand(M, K)  # the fp32 call's shape, nothing allocated
        return why_not_native(x32, weight.float(), None if bias is None else bias.float())
    tensors = [t for t in (x, weight, bias) if t is not None]
    if any(t.device.type != "cpu" or t.dtype not in (torch.float32, torch.bfloat16)
           for t in tensors) or len({t.dtype for t in tensors}) > 1:
        return ("torch's GEMM: the native tiles take float32 or bfloat16 CPU tensors "
                "(all of one dtype) only")
    if weight.dim() != 2 or weight.shape[0] % 16 or weight.shape[1] % 16 or \
            x.shape[-1] != weight.shape[1]:
        return "weight (N, K) with N % 16 == 0, K % 16 == 0 and x (..., K)"
    if not _bias_of_n(bias, weight):
        return _BIAS_REASON
    if _small(x, weight.shape[0]):
        return f"fewer than {SMALL} multiply-adds (the call's fixed cost would dominate)"
    if torch.compiler.is_exporting():
        return _exported_reason(*weight.shape)
    return _measured_reason(x.numel() // x.shape[-1], *weight.shape)


def _measured_reason(M: int, N: int, K: int) -> str | None:
    """Why an fp32 ``(M, K) x (N, K)^T`` call that the native op can take runs torch's GEMM
    (forced, the build failed, or measured slower for its shape class), or None."""
    if N % 16 or K % 16:
        return "weight (N, K) with N % 16 == 0, K % 16 == 0 and x (..., K)"
    side = linear_choice.forced()
    reason = load()
    if reason is not None:
        if side == "native":  # forced where it cannot run: refused (mha.ops.forcing), never F.linear
            raise RuntimeError(forcing.refusal(
                linear_choice.ENV, "native", {"native": reason, "torch": None, "measure": None},
                "the measured side"))
        return reason
    if side is not None:
        return None if side == "native" else f"torch's GEMM: forced by {linear_choice.ENV}=torch"
    measured = linear_choice.choose(M, N, K, kernel())
    return None if measured.choice == "native" else measured.describe()


# Under torch.export the rows are a range, which has no shape class (and reading them would fix
# it): the choice is the one measured at linear_choice.MIN_ROWS rows, the tiles' speed (as the
# fused forward measures). Computed at trace time from the weight's (N, K) alone, on real
# tensors (build.ask: a first measurement of a class must time real GEMMs, not the tracer's
# fake ones); strict export (dynamo) calls these rather than tracing the build and the timing.

@torch.compiler.assume_constant_result
def _exported_reason(N: int, K: int) -> str | None:
    return build.ask(lambda: _measured_reason(linear_choice.MIN_ROWS, N, K))


@torch.compiler.assume_constant_result
def _exported_bf16_side(N: int, K: int) -> tuple[str, str]:
    return build.ask(lambda: _bf16_choice(linear_choice.MIN_ROWS, N, K))


@functools.cache
def bf16_tiles() -> bool:
    """Whether the native op has its bf16 tiles (``vdpbf16ps``: a build for a CPU with
    AVX512_BF16), ``torch.ops.mha.linear_bf16``."""
    return load() is None and bool(build.ask(torch.ops.mha.linear_bf16_tiles))


_BIAS_REASON = ("torch's GEMM: the native tiles add a bias of shape (N,) only (F.linear "
                "broadcasts any other)")


def _bias_of_n(bias, weight) -> bool:
    """No bias, or one of shape ``(N,)``: what the native tiles add (F.linear broadcasts any
    bias to ``(..., N)``, e.g. ``(1, N)`` or a scalar, or refuses it)."""
    return bias is None or (bias.dim() == 1 and bias.shape[0] == weight.shape[0])


def _bf16_side(x, weight, bias) -> tuple[str, str] | None:
    """``(side, why)`` for a bfloat16 CPU projection big enough to measure, side ``"tiles"``
    (the native bf16 tiles), ``"upcast"`` (fp32 on upcast inputs, then the fp32 choice) or
    ``"torch"`` (torch's bf16 GEMM); None for any other call. The native side is the bf16 tiles
    where the build has them and the shape suits them (``N % 16 == 0``, ``K % 16 == 0``), else
    the upcast."""
    if x.dtype != torch.bfloat16 or _traced_reason() is not None:
        return None
    tensors = [t for t in (x, weight, bias) if t is not None]
    if any(t.device.type != "cpu" or t.dtype != torch.bfloat16 for t in tensors) or \
            weight.dim() != 2 or x.shape[-1] != weight.shape[1] or \
            not _bias_of_n(bias, weight) or _small(x, weight.shape[0]):
        return None
    if torch.compiler.is_exporting():
        return _exported_bf16_side(*weight.shape)
    return _bf16_choice(x.numel() // x.shape[-1], *weight.shape)


def _bf16_choice(M: int, N: int, K: int) -> tuple[str, str]:
    """``(side, why)`` of :func:`_bf16_side` for a bf16 ``(M, K) x (N, K)^T`` call."""
    tiles = bf16_tiles() and N % 16 == 0 and K % 16 == 0
    native = "tiles" if tiles else "upcast"
    side = linear_choice.forced()
    if side is not None:
        if side == "torch":
            return "torch", f"torch's bf16 GEMM: forced by {linear_choice.ENV}=torch"
        ours = "the native bf16 tiles" if tiles else "an fp32 GEMM on upcast inputs"
        return native, f"{ours}: forced by {linear_choice.ENV}=native"
    measured = linear_choice.choose(M, N, K, _kernel_or_none(), bf16=True, tiles=tiles)
    return (native if measured.choice == "native" else "torch"), measured.describe()


def _kernel_or_none() -> str:
    """The native build's key, or ``none`` where it did not build (the bf16 choice compares
    two torch paths, so it does not need the extension)."""
    return kernel() if load() is None else "none"


def describe(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """Which GEMM :func:`linear` runs for these arguments, and why, in one sentence."""
    bf16 = _bf16_side(x, weight, bias)
    if bf16 is not None:
        side, why = bf16
        if side != "upcast":
            return why
        M, (N, K) = x.numel() // x.shape[-1], weight.shape
        x32 = torch.empty(()).expand(M, K)  # the fp32 call's shape, nothing allocated
        b32 = None if bias is None else bias.float()
        return f"{why}; in fp32, {describe(x32, weight.float(), b32)}"
    reason = why_not_native(x, weight, bias)
    if reason is None:
        if linear_choice.forced() == "native":
            return f"the native tiles: forced by {linear_choice.ENV}=native"
        M, (N, K) = x.numel() // x.shape[-1], weight.shape
        return linear_choice.choose(M, N, K, kernel()).describe()
    return reason if reason.startswith("torch's GEMM") else f"torch's GEMM (F.linear): {reason}"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x ``(..., K)``, weight ``(N, K)``, bias ``(N,)`` ->
    ``(..., N)``, on the native fp32 tiles when :func:`why_not_native` finds no reason. bfloat16
    projections run on the native bf16 tiles, or in fp32 on upcast inputs, where that was
    measured faster than torch's bf16 GEMM (:func:`_bf16_side`)."""
    side = _bf16_side(x, weight, bias)
    if side is not None and side[0] == "upcast":
        b = None if bias is None else bias.float()
        y = linear(x.float(), weight.float(), b)  # (..., N) fp32: exact products, fp32 sums
        return y.to(torch.bfloat16)  # one rounding, as torch's bf16 GEMM rounds its fp32 sums
    if side is not None and side[0] == "tiles":
        op, function = torch.ops.mha.linear_bf16, _LinearBf16
    elif side is None and x.dtype == torch.float32 and why_not_native(x, weight, bias) is None:
        op, function = torch.ops.mha.linear, _Linear
    else:
        return F.linear(x, weight, bias)
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)  # (..., K) -> (M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, weight, bias)):
        out = function.apply(x2, weight, bias)
    else:
        out = op(x2, weight, bias)
    return out.view(*lead, weight.shape[0])  # (M, N) -> (..., N)


class _Linear(torch.autograd.Function):
    """``x W^T + b`` with native gradients: grad_x = grad_out W, grad_w = grad_out^T x (the
    tiles read grad_out through its strides, so nothing is transposed), grad_b = sum of rows.
    Under ``create_graph=True`` (grad mode on inside backward) the same three products are torch
    ops, so the gradients are themselves differentiable."""

    @staticmethod  # (a staticmethod: strict torch.export's dynamo inlines no classmethod)
    def forward(ctx, x2, weight, bias):  # x2 (M, K), weight (N, K), bias (N,) or None
        return _forward(ctx, x2, weight, bias, torch.ops.mha.linear, "linear_backward")

    @staticmethod
    def backward(ctx, grad_out):  # grad_out (M, N)
        x2, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        gb = grad_out.sum(0) if ctx.has_bias and need_b else None  # (M, N) -> (N,)
        if torch.is_grad_enabled():  # create_graph=True: differentiable products
            gx = grad_out @ weight if need_x else None  # (M, N) @ (N, K) -> (M, K)
            gw = grad_out.t() @ x2 if need_w else None  # (N, M) @ (M, K) -> (N, K)
            return gx, gw, gb
        gx, gw = getattr(torch.ops.mha, ctx.backward_op)(grad_out, x2, weight, need_x, need_w)
        return (gx if need_x else None), (gw if need_w else None), gb


class _LinearBf16(_Linear):
    """The same function on the bf16 tiles: products of bf16 values summed in fp32, each
    gradient rounded to bf16 once (as torch's bf16 GEMM rounds its own)."""

    @staticmethod
    def forward(ctx, x2, weight, bias):  # x2 (M, K), weight (N, K), bias (N,) or None
        return _forward(ctx, x2, weight, bias, torch.ops.mha.linear_bf16, "linear_bf16_backward")


def _forward(ctx, x2, weight, bias, op, backward_op: str):
    """The forward of both functions: ``op`` (a ``torch.ops.mha`` GEMM) on the inputs, with
    what the backward needs kept on ``ctx`` (``backward_op``: the name of its gradient op)."""
    ctx.save_for_backward(x2, weight)
    ctx.has_bias = bias is not None
    ctx.backward_op = backward_op  # torch.ops.mha.<name>
    return op(x2, weight, bias)


def linear_module(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` through :func:`linear`."""
    return linear(x, layer.weight, layer.bias)
