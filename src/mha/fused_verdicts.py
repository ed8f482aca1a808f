"""Why :class:`mha.MultiHeadAttention` runs a call fused or step by step, condition by condition.

The module's fused forward (:mod:`mha.ops.self_attention`: the QKV projection, attention and
W_O in one native call) serves a call only when every condition below holds; otherwise the
module runs step by step (projections, :func:`mha.attention`, W_O). The module's gate
(``MultiHeadAttention._fused_plan`` and :func:`mha.ops.self_attention.why_not_fused`) stops at
the first condition that fails, as a hot path should; :func:`fused_conditions` checks each one
on its own and says in words what holds or fails, as :func:`mha.explain` does per backend.
:meth:`mha.MultiHeadAttention.explain` prints them above its ``forward: ...`` line.

Shape legend: B batch, T sequence length, d_model model width, h query heads, h_kv key/value
heads, d head dim, N_out the output width of W_O.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mha.ops import linear_choice
from mha.ops import self_attention as fused

UNSERVED_HELP = "masks but causal, modes, dropout, weights and score variants run step by step"


@dataclass(frozen=True)
class Condition:
    """One condition of the fused forward: ``holds`` True, False, or None (not checked, because
    a condition it rests on fails), and ``words`` saying what holds or why not."""

    name: str
    holds: bool | None
    words: str

    def __str__(self) -> str:
        state = {True: "holds", False: "fails", None: "not checked"}[self.holds]
        return f"{self.name:<11} {state}: {self.words}"


def unserved(call: dict) -> list[str]:
    """The options of ``call`` (masks, mode, dropout, weights, score variants; by name) that
    the fused forward does not serve, sorted: those set to anything but None, False or 0.
    ``causal`` is served."""
    return sorted(n for n, t in call.items() if n != "causal"
                  and not (t is None or t is False or (isinstance(t, (int, float)) and t == 0)))


def fused_conditions(module, query: torch.Tensor, self_attention: bool,
                     call: dict) -> list[Condition]:
    """Every condition of the fused forward for ``module(query, ...)``: ``self_attention``
    (no key / value given) and ``call`` (the call's options by name, the module's score
    variants and dropout included, as ``MultiHeadAttention._fused_plan`` takes them). Under the
    grad mode this is called in; ``torch.compile`` tracing (which also runs step by step) is
    not among them."""
    tiles = _tiles(query.dtype) if query.dtype in fused.DTYPES else \
        Condition("tiles", None, "the fused op has bf16 and fp32 tiles only (see inputs)")
    return [_dtype(module, query), _layout(module, self_attention), _call(call),
            _projections(module), _gradient(module, query), _shape(module, query), tiles,
            _speed(module, query, tiles.holds)]


def _weights(module) -> list[tuple[str, torch.Tensor]]:
    """The fused forward's weights by name (those of the packed layout only)."""
    if not module.packed:
        return []
    out = [("in_proj.weight", module.in_proj.weight), ("in_proj.bias", module.in_proj.bias),
           ("out_proj.weight", module.out_proj.weight), ("out_proj.bias", module.out_proj.bias)]
    return [(n, t) for n, t in out if t is not None]


def _dtype(module, query) -> Condition:
    tensors = [("query", query), *_weights(module)]
    dtype = query.dtype
    odd = [f"{n} {t.dtype} on {t.device}" for n, t in tensors
           if t.dtype != dtype or t.device.type != "cpu"]
    if dtype in fused.DTYPES and not odd:
        return Condition("inputs", True, f"{dtype} CPU tensors, the weights of the same dtype")
    got = odd if dtype in fused.DTYPES else [f"query {dtype} on {query.device}", *odd]
    return Condition("inputs", False, "the fused forward takes bfloat16 or float32 CPU tensors, "
                     f"all of one dtype (got {', '.join(dict.fromkeys(got))})")


def _layout(module, self_attention: bool) -> Condition:
    h, h_kv = module.num_heads, module.num_kv_heads
    failing = []
    if not self_attention:
        failing.append("key / value given (cross-attention)")
    if not module.packed:
        failing.append(f"separate Q, K, V projections (kdim={module.kdim}, vdim={module.vdim}, "
                       f"d_model={module.d_model})")
    if h_kv != h:
        failing.append(f"grouped key/value heads (h_kv={h_kv}, h={h})")
    if module.v_head_dim != module.head_dim:
        failing.append(f"value head dim {module.v_head_dim} != query/key head dim "
                       f"{module.head_dim}")
    if module.tensor_parallel != 1:
        failing.append(f"heads split over {module.tensor_parallel} ranks")
    if failing:
        return Condition("layout", False, "the fused forward serves self-attention with the "
                         "packed [W^Q; W^K; W^V], equal query and key/value heads, on one rank; "
                         f"here: {'; '.join(failing)}")
    return Condition("layout", True, f"self-attention, packed [W^Q; W^K; W^V], h = h_kv = {h}, "
                     "one rank")


def _projections(module) -> Condition:
    """The fused forward reads ``nn.Linear`` weights; packed modules
    (:func:`mha.llm.weights.pack_weights`) keep theirs in their own kernel's layout."""
    if not module.packed:
        return Condition("projections", None, "the packed [W^Q; W^K; W^V] only (see layout)")
    odd = [f"{n} is {type(m).__name__}" for n, m in (("in_proj", module.in_proj),
                                                     ("out_proj", module.out_proj))
           if not isinstance(m, nn.Linear)]
    if odd:
        return Condition("projections", False, "the projections are packed modules "
                         f"(mha.llm.weights.pack_weights; {', '.join(odd)}); the fused forward "
                         "reads nn.Linear weights")
    return Condition("projections", True, "in_proj and out_proj are nn.Linear")


def _call(call: dict) -> Condition:
    on = unserved(call)
    if on:
        return Condition("options", False, f"the fused forward has no {', '.join(on)} "
                         f"({UNSERVED_HELP})")
    causal = "causal, served" if call.get("causal") else "not causal"
    return Condition("options", True, f"no mask, mode, dropout, weights or score variant "
                     f"({causal})")


def _gradient(module, query) -> Condition:
    if not torch.is_grad_enabled():
        return Condition("gradient", True, "grad mode is off (no_grad / inference_mode)")
    grads = [n for n, t in [("query", query), *_weights(module)] if t.requires_grad]
    if grads:
        return Condition("gradient", False, f"a gradient is needed ({', '.join(grads)} require "
                         "grad, grad mode on): the fused forward is for inference (call under "
                         "torch.no_grad() or torch.inference_mode())")
    return Condition("gradient", True, "nothing requires grad")


def _shape(module, query) -> Condition:
    T, D = query.shape[1], query.shape[-1]
    d, n_out = module.head_dim, module.out_proj.weight.shape[0]
    parts = [(1 <= T <= fused.MAX_T, f"T={T} <= {fused.MAX_T}", f"T={T} not in 1..{fused.MAX_T}"),
             (d % 16 == 0, f"d={d} % 16 == 0", f"head dim d={d} not a multiple of 16"),
             (D % 16 == 0, f"d_model={D} % 16 == 0", f"d_model={D} not a multiple of 16"),
             (n_out % 16 == 0, f"N_out={n_out} % 16 == 0", f"N_out={n_out} not a multiple of 16")]
    failing = [bad for ok, _, bad in parts if not ok]
    if failing:
        return Condition("shape", False, f"{'; '.join(failing)} (the fused forward serves "
                         f"T <= {fused.MAX_T}, head dim and widths multiples of 16)")
    return Condition("shape", True, ", ".join(good for _, good, _ in parts))


def _tiles(dtype: torch.dtype) -> Condition:
    missing = fused.tiles(dtype)
    kind = fused.DTYPES[dtype]
    if missing is not None:
        return Condition("tiles", False, missing)
    return Condition("tiles", True, f"the native op has the {kind} tiles")


def _speed(module, query, tiles: bool | None) -> Condition:
    side = linear_choice.forced()
    if side == "torch":
        return Condition("speed", False, f"forced off by {linear_choice.ENV}=torch")
    if side == "native":
        return Condition("speed", True, f"forced on by {linear_choice.ENV}=native")
    if not tiles or not module.packed:
        return Condition("speed", None, "no tiles of this dtype to measure (see inputs, tiles)"
                         if not tiles else "measured for the packed layout only (see layout)")
    B, T, D = query.shape
    kind = fused.DTYPES[query.dtype]
    m = fused._measured(B * T, module.in_proj.weight.shape[0], D, query.dtype)
    ratio = m.torch_s / m.native_s  # the tiles' speed over torch's GEMM
    where = (f"on the QKV projection's shape class (M={m.shape[0]}, N={m.shape[1]}, "
             f"K={m.shape[2]}) on {m.cpu}")
    if m.native_s > fused.TILES_MARGIN * m.torch_s:
        return Condition("speed", False, f"the {kind} tiles ran at {ratio:.2f}x the speed of "
                         f"torch's {kind} GEMM (at least 1/{fused.TILES_MARGIN} required) {where}")
    return Condition("speed", True, f"the {kind} tiles ran at {ratio:.2f}x the speed of torch's "
                     f"{kind} GEMM (at least 1/{fused.TILES_MARGIN} required) {where}")
