"""The native ops: C++ kernels in ``mha/csrc`` registered as ``torch.ops.mha.*``.

The layers of mha, top down: the public API (``mha.attention``, ``MultiHeadAttention``) →
dispatch (``mha.dispatch``: the first backend whose capabilities fit the call) → backends
(``mha.backends.*``: thin adapters with capabilities as data) → **ops** (this package) →
kernels (``mha/csrc``).

* :mod:`mha.ops.build` — compiling and caching the extensions (atomic, one build at a time
  across processes) and :func:`~mha.ops.build.load_extension`, the one loader every op uses:
  it returns None when the extension is loaded and registered, or the reason it is not.
* :mod:`mha.ops.flash` — the flash-attention forward and fused backward (``mha_flash``,
  ``mha_flash_bwd``), their fake twins and autograd, and which tile kernel each dtype runs.
* :mod:`mha.ops.flash_choice` — the flash kernels' bf16 tiles (``vdpbf16ps`` or widened to
  fp32), measured once per CPU model and cached, with :mod:`mha.ops.linear_choice`'s machinery
  (the projections' measured GEMM choice).
* :mod:`mha.ops.decode` — the decode kernel (``mha_decode``): a few queries, a long cache.
* :mod:`mha.ops.linear` — the module's projections on the same register tiles (``mha_linear``).

Imports are lazy everywhere: ``import mha`` loads no extension and compiles nothing; the first
call that needs an op builds it (or reuses the cached build, a ``dlopen``). Backends ask the op
module's ``unavailable()`` and turn a reason into a rejection that ``mha.explain`` shows.

The op functions here take arguments that the public API has already validated
(``mha.checks``); the C++ kernels keep their own guards (``TORCH_CHECK``) so that a direct
call with bad input raises an error, never reads out of bounds.
"""
