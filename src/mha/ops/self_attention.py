"""The module's self-attention forward in one native call, in bf16 or fp32
(``torch.ops.mha.self_attention_bf16`` / ``self_attention_f32``,
``csrc/linear/self_attention.cpp``): the packed QKV projection, attention over every head and
W_O on the native tiles, for short sequences, when nothing needs a gradient.

Shape legend: B batch, T sequence length, D model width, h heads, d head dim; x ``(B, T, D)``,
``W_qkv (3 h d, D)`` = ``[W^Q; W^K; W^V]``, ``W_O (N_out, h d)`` (``nn.Linear`` layout).

Why: at B = 32, T = 20, D = 512, h = 8 (the seeds' size), the module run step by step spends
as much time between its GEMMs (the QKV output written past L2 and read back by attention, one
operator call per step) as its GEMMs run above torch's; the fused call keeps a group of batch
rows' Q, K, V in the thread's cache and skips the steps' calls (docs/module.md, "The fused
forward"). Where the GEMMs are at parity (bf16 here, fp32 against MKL's AVX-512 GEMM) that is
the whole margin.

When: :func:`why_not_fused` is None — bfloat16 or float32 CPU tensors (all of one dtype), the
native op built with the dtype's AVX-512 tiles (bf16: AVX512_BF16), ``T <= MAX_T``,
``d % 16 == 0``, ``D`` and ``N_out`` multiples of 16, and the dtype's native tiles measured no
slower than ``1 / TILES_MARGIN`` of torch's GEMM of that dtype on the QKV projection's shape
class at no fewer than 512 rows (:mod:`mha.ops.linear_choice`: on a CPU whose GEMM runs far
above the tiles, e.g. bf16 on AMX, the step-by-step module keeps torch's GEMMs).
``MHA_LINEAR=torch`` turns it off, ``MHA_LINEAR=native`` on wherever it can run. The module
checks the rest (no mask but ``causal``, no score variant, cache, dropout, weights or trace;
self-attention with equal head counts; ``rope`` is served, turning Q and K after the
projection by the module's tables).

``causal``: query ``i`` sees keys ``j <= i`` (T queries and T keys, so top-left and
bottom-right alignment agree); for T = 4, True = may attend::

    1 0 0 0
    1 1 0 0
    1 1 1 0
    1 1 1 1

The kernel sums each query over the keys it sees only: a NaN or Inf in key or value ``j``
reaches rows ``i >= j`` only, as SDPA with ``is_causal=True``.
"""

from __future__ import annotations

import torch

from mha.ops import build, linear, linear_choice

MAX_T = 64  # longest sequence the fused call serves (csrc: kMaxT)
TILES_MARGIN = 1.10  # the native tiles may be this much slower than torch's GEMM alone: at GEMM
                     # parity the fused call took 10-25 % less than the step-by-step module
DTYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}  # what the fused call takes


def tiles(dtype: torch.dtype) -> str | None:
    """Why the native op cannot run the fused forward in ``dtype`` in this build, or None."""
    if dtype == torch.bfloat16:
        return None if linear.bf16_tiles() else \
            "the native op has no bf16 tiles in this build (needs AVX512_BF16)"
    if linear.load() is not None or not build.ask(torch.ops.mha.linear_vectorized):
        return "the native op has no AVX-512 fp32 tiles in this build"
    return None


def why_not_fused(x: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor | None,
                  w_o: torch.Tensor, b_o: torch.Tensor | None, heads: int) -> str | None:
    """Why the fused forward does not serve these arguments, or None when it does."""
    dtype = x.dtype  # (is_cpu and dtype: a third of the time of t.device.type and a set)
    if dtype not in DTYPES or not all(t is None or (t.is_cpu and t.dtype == dtype)
                                      for t in (x, w_qkv, b_qkv, w_o, b_o)):
        return "the fused forward takes bfloat16 or float32 CPU tensors (all of one dtype) only"
    if torch.compiler.is_compiling():
        return "torch.compile is tracing"
    B, T, D = x.shape
    hd = w_o.shape[1]
    d = hd // heads
    if not (1 <= T <= MAX_T and hd == heads * d and d % 16 == 0 and D % 16 == 0
            and w_o.shape[0] % 16 == 0 and tuple(w_qkv.shape) == (3 * hd, D)):
        return (f"the fused forward serves T <= {MAX_T}, head dim % 16 == 0 and widths % 16 == 0 "
                f"(got T={T}, d={d}, D={D}, N_out={w_o.shape[0]})")
    missing = tiles(x.dtype)
    if missing is not None:
        return missing
    side = linear_choice.forced()
    if side == "torch":
        return f"forced off by {linear_choice.ENV}=torch"
    if side == "native":
        return None
    measured = _measured(B * T, 3 * hd, D, x.dtype)
    if measured.native_s > TILES_MARGIN * measured.torch_s:
        kind = DTYPES[x.dtype]
        return (f"the {kind} tiles measured {measured.native_s / measured.torch_s:.2f}x slower "
                f"than torch's {kind} GEMM (more than {TILES_MARGIN}x) for the QKV projection's "
                f"shape class on {measured.cpu}")
    return None


def describe(x, w_qkv, b_qkv, w_o, b_o, heads: int, *, causal: bool = False,
             rope: bool = False) -> str:
    """One sentence: whether the fused forward runs for these arguments (``causal`` or not,
    Q and K turned by ``rope`` or not), and why."""
    reason = why_not_fused(x, w_qkv, b_qkv, w_o, b_o, heads)
    if reason is not None:
        return f"step by step: {reason}"
    kind = DTYPES[x.dtype]
    attention = ("RoPE on Q and K, " if rope else "") + \
        ("causal attention" if causal else "attention")
    if linear_choice.forced() == "native":
        return (f"fused {kind} forward (one call, {attention}): forced by "
                f"{linear_choice.ENV}=native")
    B, T, D = x.shape
    m = _measured(B * T, w_qkv.shape[0], D, x.dtype)
    return (f"fused {kind} forward (one call: QKV, {attention} and W_O on the {kind} tiles): the "
            f"tiles ran at {m.torch_s / m.native_s:.2f}x the speed of torch's {kind} GEMM (at "
            f"least 1/{TILES_MARGIN} required) on the QKV projection's shape class "
            f"(M={m.shape[0]}, N={m.shape[1]}, K={m.shape[2]}) on {m.cpu}")


def _measured(M: int, N: int, K: int, dtype: torch.dtype) -> linear_choice.Measured:
    """The dtype's native tiles against torch's GEMM of that dtype on the QKV projection's shape
    class, at no fewer than ``linear_choice.MIN_ROWS`` rows: the kernels' speed (fp32: the
    projections' own fp32 measurement). At a few rows the GEMM's time is mostly packing the
    weight, which the fused call pays whichever GEMM the step-by-step module would use
    (measured in bf16 at B1 T8 d_model 512: the M = 8 class had the tiles 1.38x slower, the
    fused call ran 1.10x nn.MultiheadAttention against 0.89x step by step)."""
    bf16 = dtype == torch.bfloat16
    return linear_choice.choose(max(M, linear_choice.MIN_ROWS), N, K, linear.kernel(),
                                bf16=bf16, tiles=bf16)


def self_attention(x: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor | None,
                   w_o: torch.Tensor, b_o: torch.Tensor | None, heads: int, scale: float,
                   panels: Panels | None = None, *, causal: bool = False,
                   rope: tuple[torch.Tensor, torch.Tensor, bool] | None = None) -> torch.Tensor:
    """``(B, T, D) -> (B, T, N_out)``: ``W_O(attention(x W_qkv^T + b_qkv)) + b_O`` in one native
    call, in x's dtype (bf16 or fp32; no autograd: the caller makes sure nothing needs a
    gradient). ``panels``: the two weights packed once (a frozen module's, :class:`Panels`);
    without them the call packs both. ``causal``: query ``i`` sees keys ``j <= i``. ``rope``:
    ``(C, S, interleaved)``, the float32 ``(B|1, T, r)`` tables of
    :meth:`mha.rope.Rotary.angles`: Q and K of every head turned on their first ``r`` dims
    (in fp32, rounded once to x's dtype) before attention."""
    wq_p, wo_p = (None, None) if panels is None else panels.current(w_qkv, w_o)
    op = (torch.ops.mha.self_attention_bf16 if x.dtype == torch.bfloat16
          else torch.ops.mha.self_attention_f32)
    C, S, interleaved = (None, None, False) if rope is None else rope
    if C is not None:
        C, S = C.contiguous(), S.contiguous()  # (B|1, T, r) each
    return op(x.contiguous(), w_qkv, b_qkv, w_o, b_o, heads, float(scale), wq_p, wo_p, causal,
              C, S, interleaved)


class Panels:
    """``W_qkv`` and ``W_O`` packed once into the fused call's panels, for a frozen module
    (:meth:`mha.MultiHeadAttention.freeze`): ``torch.ops.mha.pack_panels_bf16``
    (``(ceil(N / 64), K / 2, 64, 2)`` bf16 pairs) or ``pack_panels_f32``
    (``(ceil(N / 64), K, 64)`` fp32), by the weight's dtype.

    Each weight's panels are kept with what identifies its contents — the tensor, its storage
    pointer, its version counter and its dtype — and :meth:`current` packs a weight again when
    any of these moved: an optimizer step, ``load_state_dict``, ``nn.init``, any in-place op on
    the parameter or on a ``detach()``-ed view, ``p.data = t``, a dtype change. Writes that
    bypass the version counter (through ``p.data`` or ``.numpy()``) are not seen: that is the
    price of not packing per call, and why freezing is an explicit choice."""

    def __init__(self) -> None:
        # name -> (the weight, its (storage pointer, version, shape, strides, dtype), panels);
        # holding the weight keeps its storage, so a pointer seen here is never reused
        self._packed: dict[str, tuple[torch.Tensor, tuple, torch.Tensor]] = {}
        #: how many times a weight was packed (2 by freeze(), +1 per weight that moved)
        self.packs = 0

    @staticmethod
    def _key(w: torch.Tensor) -> tuple:
        return (w.data_ptr(), w._version, tuple(w.shape), tuple(w.stride()), w.dtype)

    def current(self, w_qkv: torch.Tensor, w_o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The panels of ``w_qkv`` and ``w_o`` as they are now (packed again if they moved)."""
        return self._panels("w_qkv", w_qkv), self._panels("w_o", w_o)

    def _panels(self, name: str, w: torch.Tensor) -> torch.Tensor:
        key = self._key(w)
        hit = self._packed.get(name)
        if hit is not None and hit[0] is w and hit[1] == key:
            return hit[2]
        with torch.no_grad():
            if w.dtype == torch.bfloat16:
                packed = torch.ops.mha.pack_panels_bf16(w)  # (N, K) -> (ceil(N/64), K/2, 64, 2)
            else:
                packed = torch.ops.mha.pack_panels_f32(w)  # (N, K) -> (ceil(N / 64), K, 64)
        self._packed[name] = (w, key, packed)
        self.packs += 1
        return packed
