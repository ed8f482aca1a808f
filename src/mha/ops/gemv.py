"""Weight-stationary projections for a few rows: ``x W^T + b`` with W packed once, in bf16 or
int8, into the order the native loop streams it (``csrc/linear/gemv.cpp``, extension
``mha_gemv``).

Shape legend: x ``(..., K)``, weight ``(N, K)`` (``nn.Linear`` layout), bias ``(N,)``; M = the
rows of x (the product of its leading dims); P = ceil(N / 32) panels of 32 output columns,
Kp = K rounded up to even.

Decoding one token, a projection reads its whole weight for one multiply-add per element, so
its time is the weight's bytes over the memory's read bandwidth; fp32 weights read by torch's
GEMM also run well below that bandwidth. :func:`pack` stores the weight once as

* ``"bf16"``: ``(P, Kp / 2, 32, 2)`` bf16 — per pair of k, 32 columns x (k even, k odd);
* ``"int8"``: ``(P, Kp / 2, 2, 32)`` int8 and a scale per output column, ``W ~ q * scale``
  with ``scale = max |W[n, :]| / 127`` (round to nearest),

and :func:`gemv` multiplies the widened weights with fp32 activations (exact products, fp32
sums). A weight row holding NaN or Inf gives NaN in that output column with int8 (its scale is
not finite); with bf16 non-finite weights propagate as in fp32 arithmetic.

:func:`gemv` is for few rows (decode; it is correct for any M, but past ~16 rows a GEMM that
reuses each weight across rows is faster: :class:`mha.llm.weights.PackedLinear` switches there).
Without the extension (no compiler) :func:`gemv` runs :func:`reference` — the same math in torch
ops on the unpacked weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mha.ops import build

NAME = "mha_gemv"
SOURCES = ("linear/gemv.cpp",)
COLS = 32  # output columns per panel
KINDS = ("bf16", "int8")


def load() -> str | None:
    """Build (or reuse) and load the extension; the reason it is unavailable, or None."""
    return build.load_extension(NAME, SOURCES, register=_register,
                                instead="packed projections run in torch ops")


def _register() -> None:
    torch.library.register_fake("mha::gemv")(_fake)


def _fake(x, packed, scale, n, k, bias):
    torch._check(x.dim() == 2 and x.shape[1] == k)
    return x.new_empty((x.shape[0], n))  # (M, K) -> (M, N)


@dataclass(frozen=True)
class Packed:
    """A weight ``(N, K)`` packed by :func:`pack`: ``data`` in the kind's layout, ``scale``
    ``(P * 32,)`` fp32 for int8 (None for bf16)."""

    data: torch.Tensor
    scale: torch.Tensor | None
    n: int
    k: int
    kind: str

    @property
    def nbytes(self) -> int:
        """Bytes a one-row product reads (the packed weight and its scales)."""
        extra = 0 if self.scale is None else self.scale.numel() * 4
        return self.data.numel() * self.data.element_size() + extra

    def unpack(self) -> torch.Tensor:
        """The weight as the kernel sees it, ``(N, K)`` fp32 (bf16- or int8-rounded)."""
        P, Kp = self.data.shape[0], self.data.shape[1] * 2
        if self.kind == "bf16":
            w = self.data.float().permute(0, 2, 1, 3)  # (P, Kp/2, 32, 2) -> (P, 32, Kp/2, 2)
        else:
            w = self.data.float().permute(0, 3, 1, 2)  # (P, Kp/2, 2, 32) -> (P, 32, Kp/2, 2)
        w = w.reshape(P * COLS, Kp)  # (P, 32, Kp/2, 2) -> (P*32, Kp)
        if self.scale is not None:
            w = w * self.scale[:, None]  # (P*32, Kp) * (P*32, 1)
        return w[: self.n, : self.k].contiguous()  # (N, K)


def _check_weight(weight: torch.Tensor, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor (N, K), got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    if weight.device.type != "cpu" or not weight.is_floating_point():
        raise ValueError(f"weight must be a floating-point CPU tensor, got {weight.dtype} on "
                         f"{weight.device}")


def pack(weight: torch.Tensor, kind: str = "bf16") -> Packed:
    """Pack ``weight (N, K)`` (any float dtype) for :func:`gemv`; the weight is not changed."""
    _check_weight(weight, kind)
    N, K = weight.shape
    P, Kp = -(-N // COLS), K + K % 2
    w = torch.zeros(P * COLS, Kp, dtype=torch.float32)  # (P*32, Kp), zero past N and K
    with torch.no_grad():
        w[:N, :K] = weight.detach().float()
    if kind == "bf16":
        data = w.to(torch.bfloat16).view(P, COLS, Kp // 2, 2)  # (P*32, Kp) -> (P, 32, Kp/2, 2)
        return Packed(data.permute(0, 2, 1, 3).contiguous(), None, N, K, kind)  # (P, Kp/2, 32, 2)
    amax = w.abs().amax(dim=1)  # (P*32,)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # (P*32,); 1 for zero rows
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127)  # (P*32, Kp); NaN stays NaN
    q = torch.nan_to_num(q, nan=0.0)  # int8 has no NaN: the column's NaN scale carries it
    scale = torch.where(torch.isfinite(amax), scale, torch.full_like(amax, float("nan")))
    data = q.to(torch.int8).view(P, COLS, Kp // 2, 2)  # (P*32, Kp) -> (P, 32, Kp/2, 2)
    return Packed(data.permute(0, 2, 3, 1).contiguous(), scale.contiguous(), N, K, kind)


def reference(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`gemv` in torch ops on the unpacked weight (fp32 sums): the fallback, and with
    ``x.double()`` the tests' oracle (then in fp64)."""
    w = packed.unpack().to(x.dtype if x.dtype == torch.float64 else torch.float32)
    y = x.to(w.dtype) @ w.t()  # (..., K) @ (K, N) -> (..., N)
    if bias is not None:
        y = y + bias.to(w.dtype)
    return y if x.dtype == torch.float64 else y.to(x.dtype)


def _check_call(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != packed.k:
        raise ValueError(f"x must be (..., K) with K={packed.k}, got "
                         f"{tuple(getattr(x, 'shape', ()))}")
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be a float32 or bfloat16 CPU tensor, got {x.dtype} on "
                         f"{x.device}")
    if bias is not None and (bias.shape != (packed.n,) or bias.device.type != "cpu"
                             or not bias.is_floating_point()):
        raise ValueError(f"bias must be a floating-point CPU tensor (N,) = ({packed.n},), got "
                         f"{bias.dtype} {tuple(bias.shape)}")


def gemv(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x (..., K) W^T + bias -> (..., N)`` in x's dtype (fp32 or bf16; summed in fp32) with W
    packed by :func:`pack`. The packed weight is a constant; a call that needs a gradient
    (``x`` or ``bias`` requiring grad, grad mode on) runs :func:`reference`, whose torch ops
    carry it (the kernel has no backward)."""
    _check_call(x, packed, bias)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or (bias is not None and bias.requires_grad))
    if load() is not None or needs_grad:
        return reference(x, packed, bias)
    b = None if bias is None else bias.float().contiguous()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, packed.k)  # (..., K) -> (M, K)
    y = torch.ops.mha.gemv(x2, packed.data, packed.scale, packed.n, packed.k, b)  # (M, N)
    return y.view(*lead, packed.n)  # (M, N) -> (..., N)


def vectorized() -> bool:
    """Whether the kernel runs its AVX-512 loop here (False: the portable loop, or no build)."""
    return load() is None and bool(build.ask(torch.ops.mha.gemv_vectorized))
