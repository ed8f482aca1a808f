"""``mha.linear``: the module's projections ``x W^T + b`` on mha's own tiles (fp32; bf16 on
``vdpbf16ps`` where the CPU has AVX512_BF16) or torch's GEMM, whichever was measured faster on
this CPU (:mod:`mha.ops.linear_choice`).

The public face of :mod:`mha.ops.linear` (the op, its build and its autograd live there):

* :func:`linear` — ``F.linear(x, weight, bias)`` on the native tiles when it can, else
  ``F.linear``;
* :func:`why_not_native` — why a call runs torch's GEMM (e.g. "torch's GEMM: measured 1.80x
  faster than the native tiles for (M=640, N=2048, K=512) on <cpu>"), or None;
* :func:`describe` — which GEMM a call runs and why, in one sentence;
* :func:`linear_module` — ``layer(x)`` for an ``nn.Linear`` through :func:`linear`.
"""

from mha.ops.linear import describe, linear, linear_module, why_not_native

__all__ = ["describe", "linear", "linear_module", "why_not_native"]
