"""Packed projection weights for an HF causal LM or :class:`mha.models.Llama`:
:func:`pack_weights` replaces the model's ``nn.Linear`` submodules by modules that hold their
weight packed once, in bf16 or int8, for mha's weight-stationary kernel (:mod:`mha.ops.gemv`).
In :class:`mha.models.Llama` that is each attention's ``in_proj`` (``[W^Q; W^K; W^V]``) and
``out_proj``, which :class:`mha.MultiHeadAttention` calls as modules when they are packed, the
MLP's gate and up (as one) and down, and the LM head.

Shape legend: x ``(B, T, K)``, weight ``(N, K)``; M = B T rows; I the MLP's intermediate size.

Why: decoding one token reads every projection weight once for a single multiply-add per
element, so a step's projections cost their bytes over the memory's read bandwidth
(SmolLM2-135M: 540 MB in fp32, 270 MB in bf16, 135 MB in int8 plus scales). The packed kernel
streams the narrow weights at close to the read bandwidth (``docs/llm.md`` has the figures).

* :class:`PackedLinear` — ``x W^T + b`` on the packed weight for up to :data:`GEMV_ROWS` rows
  (decode); above that (prefill) torch's bf16 GEMM on a kept bf16 copy of the same rounded
  weight (it reuses each weight across rows; on CPUs with AVX512_BF16 it ran ~4x faster than the
  fp32 GEMM: ``benchmarks/probes/gemv.py``). The prefill path rounds the activations to bf16 for
  that product; the decode path keeps them in fp32.
* :class:`PackedMLP` — a Llama-style gated MLP, ``down(act(gate(x)) * up(x))``, with gate and up
  packed as one ``(2 I, K)`` weight: one call instead of two.

The embedding stays as it is (with tied embeddings the lm_head gets a packed copy of the
weight and the embedding keeps the original). The packed modules hold constants: no gradients
(use the unpacked model to train), ``model.to(...)`` does not convert them, and they are not
in ``model.state_dict()`` (:class:`mha.models.Llama` refuses ``load_state_dict`` and
``load_hf_state_dict`` once packed: load the weights first, then pack).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mha.ops import gemv

WEIGHTS = ("fp32", "bf16", "int8")  #: fp32: the model's own nn.Linear; bf16/int8: packed
GEMV_ROWS = 16  #: rows up to which the packed kernel runs (above: the bf16 GEMM)
#: down(act(gate(x)) * up(x)): transformers' and mha.models.llama.SwiGLU
FUSED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "SwiGLU")


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight ``(N, K)`` is packed as ``kind`` ("bf16" or "int8").

    ``weight`` is the kept ``(N, K)`` bf16 copy of the rounded weight (what the kernel reads,
    for the prefill GEMM); ``bias`` stays fp32; ``source_dtype`` is the packed weight's own
    dtype (the model's, what :meth:`mha.MultiHeadAttention.new_cache` defaults to). Inputs
    are float32 or bfloat16, the kernel's (another dtype is refused on both paths: the prefill
    GEMM would round a float64 input to bf16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str) -> None:
        super().__init__()
        self.source_dtype = weight.dtype
        self.packed = gemv.pack(weight, kind)
        self.weight = self.packed.unpack().to(torch.bfloat16)  # (N, K), already bf16-exact
        self.bias = None if bias is None else bias.detach().float().clone()  # (N,)
        self.kind = kind
        self.in_features, self.out_features = self.packed.k, self.packed.n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"a packed projection ({self.kind} weights, mha.llm.weights) takes "
                            f"float32 or bfloat16 inputs, got {x.dtype} (model.to(dtype) does "
                            f"not convert packed modules): run the model in float32 or "
                            f"bfloat16, converted before packing")
        rows = x.numel() // max(x.shape[-1], 1)
        if rows <= GEMV_ROWS:
            return gemv.gemv(x, self.packed, self.bias)  # (..., K) -> (..., N), x's dtype
        b = None if self.bias is None else self.bias.to(torch.bfloat16)
        return F.linear(x.to(torch.bfloat16), self.weight, b).to(x.dtype)  # (..., N)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weights={self.kind}")


class PackedMLP(nn.Module):
    """A gated MLP ``down(act(gate(x)) * up(x))`` with gate and up packed as one weight."""

    def __init__(self, mlp: nn.Module, kind: str) -> None:
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        weight = torch.cat([gate.weight.detach(), up.weight.detach()])  # (2I, K)
        bias = None
        if gate.bias is not None or up.bias is not None:
            zeros = torch.zeros(gate.out_features)
            bias = torch.cat([zeros if gate.bias is None else gate.bias.detach().float(),
                              zeros if up.bias is None else up.bias.detach().float()])  # (2I,)
        self.gate_up = PackedLinear(weight, bias, kind)
        self.down_proj = _packed(mlp.down_proj, kind)
        self.act_fn = mlp.act_fn
        self.intermediate = gate.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)  # (..., 2I) -> 2 x (..., I)
        return self.down_proj(self.act_fn(gate) * up)  # (..., I) -> (..., K)


def _packed(layer: nn.Linear, kind: str) -> PackedLinear:
    return PackedLinear(layer.weight.detach(), layer.bias, kind)


def _fusable(module: nn.Module) -> bool:
    return (type(module).__name__ in FUSED_MLPS and callable(getattr(module, "act_fn", None)) and
            all(isinstance(getattr(module, n, None), nn.Linear)
                for n in ("gate_proj", "up_proj", "down_proj")) and
            module.gate_proj.in_features == module.up_proj.in_features and
            module.gate_proj.out_features == module.up_proj.out_features)


def check_weights(weights) -> str:
    """``weights`` checked against :data:`WEIGHTS` (ValueError naming the choices)."""
    if not isinstance(weights, str) or weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    return weights


def pack_loaded(model: nn.Module, weights: str) -> str:
    """:func:`pack_weights` for a model just loaded (``mha generate`` / ``chat`` / ``serve``):
    without the packed kernel (:func:`mha.ops.gemv.load` says why) a RuntimeWarning, and the
    model keeps its own weights. Returns the weights the model runs on."""
    if weights != "fp32" and gemv.load() is not None:
        import warnings

        warnings.warn(f"mha: weights={weights!r} needs the packed kernel ({gemv.load()}); "
                      "the projections keep the model's own weights", RuntimeWarning,
                      stacklevel=4)
        weights = "fp32"
    pack_weights(model, weights)
    return weights


def pack_weights(model: nn.Module, weights: str = "bf16") -> nn.Module:
    """Replace ``model``'s projections by packed ones, in place, and return ``model``.

    ``weights``: ``"bf16"`` (each weight rounded to bf16) or ``"int8"`` (per output channel:
    ``q * scale``, ``scale = max |row| / 127``); ``"fp32"`` changes nothing. Every
    ``nn.Linear`` becomes a :class:`PackedLinear` (q/k/v/o, lm_head, ...), and a Llama-style
    gated MLP (:data:`FUSED_MLPS`) a :class:`PackedMLP` with gate and up fused. Embeddings and
    norms stay as they are. The model must be on the CPU and in eval mode (the packed modules
    have no gradients); a refusal leaves it unchanged."""
    check_weights(weights)
    if weights == "fp32":
        return model
    if model.training:
        raise ValueError("model must be in eval mode (model.eval()): packed weights have no "
                         "gradients")
    for name, p in model.named_parameters():
        if p.device.type != "cpu":
            raise ValueError(f"model must be on the CPU; parameter {name} is on {p.device}")
    reason = gemv.load()
    if reason is not None:
        raise RuntimeError(f"packed weights need the native kernel: {reason}")
    targets = []  # (parent, attribute, new module), decided before anything changes
    fused = set()
    for name, module in model.named_modules():
        if _fusable(module):
            targets.append((name, PackedMLP(module, weights)))
            fused.add(name)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[0] not in fused:
            targets.append((name, _packed(module, weights)))
    for name, new in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
    return model


__all__ = ["FUSED_MLPS", "GEMV_ROWS", "WEIGHTS", "PackedLinear", "PackedMLP", "check_weights",
           "pack_weights"]
