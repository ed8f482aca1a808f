"""``mha.linear``: the module's projections ``x W^T + b`` on mha's own fp32 tiles.

The public face of :mod:`mha.ops.linear` (the op, its build and its autograd live there):

* :func:`linear` — ``F.linear(x, weight, bias)`` on the native tiles when it can, else
  ``F.linear``;
* :func:`why_not_native` — the reason a call falls back, or None;
* :func:`linear_module` — ``layer(x)`` for an ``nn.Linear`` through :func:`linear`.
"""

from mha.ops.linear import linear, linear_module, why_not_native

__all__ = ["linear", "linear_module", "why_not_native"]
