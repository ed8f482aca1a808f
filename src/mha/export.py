"""ONNX export of models that use mha: a standard graph that ONNX Runtime (or any runtime with
opset 23) runs without mha.

Shape legend: B batch, h / h_kv heads, Tq / Tk lengths (Tn new tokens, P cached ones), d_k /
d_v head dims, d_model width.

mha's attention dispatches to native custom ops (``torch.ops.mha.*``) that no runtime knows.
:func:`onnx` therefore traces the model with every attention call forced to the ``sdpa``
backend (:func:`mha.use_backend`): ``torch.onnx.export(..., dynamo=True)`` turns
``scaled_dot_product_attention`` into the ONNX ``Attention`` operator (opset 23) — masks as its
``attn_mask`` input, GQA as its ``q_num_heads`` / ``kv_num_heads``, ``d_v != d_k`` as is — and
the projections into ``MatMul`` / ``Gemm``. No translation table for mha's own ops is needed,
and the graph's numbers are SDPA's formula (the same math as mha's, to rounding). What SDPA
cannot compute (softcap, sinks) or what has no meaning in a graph (dropout while training,
``mask_mod`` callables) is refused at export with the reason, before any file is written.

:class:`SelfAttention`, :class:`CrossAttention` and :class:`DecodeStep` wrap a
:class:`mha.MultiHeadAttention` with named graph inputs: a key-padding mask, and for decoding
the past K/V in and the present K/V out (the standard ``past_key_values`` layout
``(B, h_kv, P, d)``), so a runtime can run generation step by step.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from mha.checks import check_bool, check_path, check_tensor
from mha.dispatch import BackendError, use_backend
from mha.functional import attention
from mha.ops.linear import torch_gemm
from mha.trace import recorder

OPSET = 23  # the first opset with the Attention operator
INSTALL_HINT = "ONNX export needs onnx and onnxscript: pip install 'mha[onnx]'"


class SelfAttention(nn.Module):
    """``module(x, mask=key_padding[:, None, None, :], causal=causal)``: inputs ``x (B, T,
    d_model)`` and, with ``key_padding``, ``keep (B, T)`` bool (True = a real key)."""

    def __init__(self, module: nn.Module, *, causal: bool = False, key_padding: bool = False):
        super().__init__()
        _check_module(module)
        self.module, self.causal = module, check_bool("causal", causal)
        self.key_padding = check_bool("key_padding", key_padding)
        self.train(module.training)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        _check_keep(keep, self.key_padding, x)
        mask = None if keep is None else keep[:, None, None, :]  # (B, T) -> (B, 1, 1, T)
        return self.module(x, mask=mask, causal=self.causal)  # (B, T, d_model)


class CrossAttention(nn.Module):
    """Queries from ``x (B, Tq, d_model)``, keys / values from ``memory (B, Tk, kdim)`` (and
    ``value (B, Tk, vdim)`` when the module's vdim differs), optional ``keep (B, Tk)``."""

    def __init__(self, module: nn.Module, *, key_padding: bool = False):
        super().__init__()
        _check_module(module)
        self.module, self.key_padding = module, check_bool("key_padding", key_padding)
        self.train(module.training)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, value: torch.Tensor | None = None,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        _check_keep(keep, self.key_padding, memory)
        mask = None if keep is None else keep[:, None, None, :]  # (B, Tk) -> (B, 1, 1, Tk)
        value = memory if value is None else value
        return self.module(x, memory, value, mask=mask)  # (B, Tq, d_model)


class DecodeStep(nn.Module):
    """One decoding step of self-attention with a K/V cache as graph inputs and outputs:
    ``(x (B, Tn, d_model), past_k (B, h_kv, P, d_k), past_v (B, h_kv, P, d_v)) -> (y (B, Tn,
    d_model), present_k (B, h_kv, P + Tn, d_k), present_v (B, h_kv, P + Tn, d_v))``. The new
    tokens attend causally, bottom-right: token ``t`` of the step sees the P cached keys and new
    keys ``<= t`` (the decoder's "token t sees 1..t"). With ``rope`` the new tokens are
    rotated at positions ``P .. P+Tn-1`` (past keys are stored rotated, as in
    :class:`mha.KVCache`). The module's score variants apply as in its own calls (ALiBi
    penalises query position minus key position, both counted from the first cached token)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        _check_module(module)
        if not module.kdim == module.vdim == module.d_model:
            raise ValueError(f"module: a decode step is self-attention, which needs kdim == vdim "
                             f"== d_model; got kdim={module.kdim}, vdim={module.vdim}, "
                             f"d_model={module.d_model}")
        self.module = module
        self.train(module.training)

    def forward(self, x, past_k, past_v):
        m = self.module
        _check_step(m, x, past_k, past_v)
        q, k, v = m.project(x, x, x, True)  # (B, Tn, h*d_k), (B, Tn, h_kv*d_k), (B, Tn, h_kv*d_v)
        q = m.split_heads(q, m.num_heads)  # (B, Tn, h*d_k) -> (B, h, Tn, d_k)
        k = m.split_heads(k, m.num_kv_heads)  # (B, Tn, h_kv*d_k) -> (B, h_kv, Tn, d_k)
        if m.rope is not None:  # the new tokens sit at P .. P+Tn-1 (from shapes alone)
            positions = past_k.shape[2] + torch.arange(x.shape[1], device=x.device)  # (Tn,)
            q, k = m.rope.apply_rotary(q, positions), m.rope.apply_rotary(k, positions)
        k = torch.cat([past_k, k], dim=2)  # (B, h_kv, P+Tn, d_k)
        v = torch.cat([past_v, m.split_heads(v, m.num_kv_heads)], dim=2)  # (B, h_kv, P+Tn, d_v)
        variants = m._variants(None, None, None)  # the module's ALiBi slopes (softcap, sinks)
        out = attention(q, k, v, causal=True, **variants)  # (B, h, Tn, d_v)
        return m._output(out, None, recorder()), k, v  # (B, Tn, d_model), present K/V


def _check_module(module) -> None:
    from mha.module import MultiHeadAttention

    if not isinstance(module, MultiHeadAttention):
        raise TypeError(f"module must be a mha.MultiHeadAttention, got {type(module).__name__}")


def _check_keep(keep, key_padding: bool, keys: torch.Tensor) -> None:
    """``keep (B, Tk)`` bool, given exactly when the wrapper was built with ``key_padding``
    (the graph's inputs follow it); ``keys (B, Tk, .)`` the input whose rows it keeps."""
    if (keep is not None) != key_padding:
        hint = ("pass keep (B, Tk) bool (True = a real key)" if key_padding else
                "do not pass keep, or build the wrapper with key_padding=True")
        raise ValueError(f"keep: the wrapper was built with key_padding={key_padding}: {hint}")
    if keep is None:
        return
    expected = f"(B, Tk) = ({keys.shape[0]}, {keys.shape[1]})"
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
        got = keep.dtype if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise TypeError(f"keep must be a bool tensor {expected} (True = a real key), got {got}")
    if tuple(keep.shape) != tuple(keys.shape[:2]):
        raise ValueError(f"keep must have shape {expected}, got {tuple(keep.shape)}")


def _check_step(m: nn.Module, x, past_k, past_v) -> None:
    """DecodeStep's inputs against the module and one another (ValueError / TypeError naming
    the input)."""
    check_tensor("x", x, 3, f"(B, Tn, d_model) = (B, Tn, {m.d_model})")
    if x.shape[2] != m.d_model:
        raise ValueError(f"x must have shape (B, Tn, d_model) = (B, Tn, {m.d_model}), got "
                         f"{tuple(x.shape)}")
    B, h_kv = x.shape[0], m.num_kv_heads
    for name, t, d, P in (("past_k", past_k, m.head_dim, "P"),
                          ("past_v", past_v, m.v_head_dim, None)):
        P = past_k.shape[2] if P is None else P
        expected = f"(B, h_kv, P, d_{name[-1]}) = ({B}, {h_kv}, {P}, {d})"
        check_tensor(name, t, 4, expected)
        if (t.shape[0], t.shape[1], t.shape[3]) != (B, h_kv, d) or \
                (name == "past_v" and t.shape[2] != P):
            raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
        if t.dtype != x.dtype or t.device != x.device:
            raise TypeError(f"{name} must be {x.dtype} like x, on {x.device}, got {t.dtype} on "
                            f"{t.device}")


def onnx(model: nn.Module, args: tuple, path, *, input_names=None, output_names=None,
         dynamic_shapes=None, opset: int = OPSET) -> Path:
    """Export ``model(*args)`` to the ONNX file ``path`` and return it.

    ``model`` is any module whose attention goes through mha (``MultiHeadAttention``, a model
    built from it, or a wrapper above). ``dynamic_shapes`` as in ``torch.export`` (e.g.
    ``({0: "B", 1: "T"},)``); ``input_names`` / ``output_names`` name the graph's values. The
    file appears complete or not at all (written aside, then renamed). Raises ValueError with
    the reason for what cannot be exported (dropout while training, softcap, sinks, ...), and
    ImportError with the install line when the exporter's packages are missing.
    """
    try:
        import onnxscript  # noqa: F401 — the dynamo exporter needs it
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple of example inputs, got {type(args).__name__}")
    path = check_path("path", path)
    _check_options(args, input_names, output_names, dynamic_shapes, opset)
    _check_exportable(model)
    if path.is_dir():
        raise ValueError(f"path: {path} is a directory; give the name of the file to write")
    if not path.parent.is_dir():
        raise ValueError(f"path: the directory {path.parent} does not exist")
    # the graph does not depend on the examples' strides, but the exporter fails on a view's
    # symbolic strides (aten.sym_stride) under dynamic shapes
    args = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.contiguous(), args)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with use_backend("sdpa"), torch_gemm(), torch.no_grad():
            try:
                program = torch.onnx.export(model, args, dynamo=True, opset_version=opset,
                                            input_names=input_names, output_names=output_names,
                                            dynamic_shapes=dynamic_shapes, verbose=False)
            except BackendError as e:
                raise ValueError(f"cannot export this model to ONNX: {e}") from None
            except Exception as e:  # the exporter wraps errors raised while tracing
                cause = _mha_error(e)
                if cause is not None:
                    raise ValueError(f"cannot export this model to ONNX: {cause}") from None
                raise
        _check_graph(program.exported_program)
        _check_opset(program, opset)
        program.save(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _max_opset() -> int:
    import onnx

    return int(onnx.defs.onnx_opset_version())


def _check_options(args: tuple, input_names, output_names, dynamic_shapes, opset) -> None:
    """The exporter's options, checked before tracing: the exporter accepts an opset it then
    fails to convert to (writing another), splits a str into one-letter names, drops extra
    names, and fails deep inside on a dimension an input does not have."""
    if type(opset) is not int:
        raise TypeError(f"opset must be an int, got {type(opset).__name__}")
    top = _max_opset()
    if not OPSET <= opset <= top:
        raise ValueError(f"opset must lie in [{OPSET}, {top}] (the Attention operator needs "
                         f"{OPSET}; this onnx knows up to {top}), got {opset}")
    inputs = len(torch.utils._pytree.tree_leaves(args))
    for what, names in (("input_names", input_names), ("output_names", output_names)):
        if names is None:
            continue
        if not isinstance(names, (list, tuple)):
            raise TypeError(f"{what} must be a list of str, got {type(names).__name__}")
        for i, name in enumerate(names):
            if not isinstance(name, str) or not name:
                raise TypeError(f"{what}[{i}] must be a non-empty str, got {name!r}")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{what}: {twice[0]!r} is given twice")
        if what == "input_names" and len(names) > inputs:
            raise ValueError(f"input_names: {len(names)} names for {inputs} input"
                             f"{'s' if inputs != 1 else ''} (the tensors of args)")
    if isinstance(dynamic_shapes, (list, tuple)):  # one entry per argument, as in torch.export
        if len(dynamic_shapes) != len(args):
            raise ValueError(f"dynamic_shapes: {len(dynamic_shapes)} entries for {len(args)} "
                             f"input{'s' if len(args) != 1 else ''} (one per element of args)")
        for i, (spec, arg) in enumerate(zip(dynamic_shapes, args, strict=True)):
            if isinstance(spec, dict) and isinstance(arg, torch.Tensor):
                for dim in spec:
                    if not isinstance(dim, int) or not 0 <= dim < arg.dim():
                        raise ValueError(f"dynamic_shapes[{i}] names dimension {dim!r} of an "
                                         f"input with {arg.dim()} dimensions")


def _mha_error(e: BaseException) -> Exception | None:
    """The refusal mha raised while the exporter traced (a BackendError, or a ValueError /
    TypeError from mha's checks, e.g. example inputs of the wrong shape), found in the chain
    of errors the exporter wraps it in; None for the exporter's own failures."""
    package = str(Path(__file__).parent)
    while e is not None:
        if isinstance(e, BackendError):
            return e
        if isinstance(e, (ValueError, TypeError)) and e.__traceback__ is not None:
            tb = e.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            if tb.tb_frame.f_code.co_filename.startswith(package):
                return e
        e = e.__cause__ or e.__context__
    return None


def _check_opset(program, opset: int) -> None:
    """The graph is in the opset asked for: where its version converter fails, the exporter
    logs the failure and keeps the graph in the opset it built (18, with an opset-23
    ``Attention`` node that no runtime loads)."""
    written = program.model.opset_imports.get("")  # the default domain's version
    if written != opset:
        raise ValueError(f"opset: the exporter could not convert the graph to opset {opset} "
                         f"(it left it in opset {written}, where the Attention operator does "
                         f"not exist); export with opset={OPSET}")


def _check_graph(program: torch.export.ExportedProgram) -> None:
    """Refuse the attention calls of the traced program that ONNX's ``Attention`` operator
    cannot compute: dropout (the operator has none; the exporter would drop it silently) and a
    scale <= 0 (ONNX Runtime refuses to load the operator then)."""
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is not sdpa:
            continue
        names = [a.name for a in sdpa._schema.arguments]
        given = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
        dropout_p, scale = given.get("dropout_p", 0.0), given.get("scale")
        if dropout_p:
            raise ValueError(f"cannot export this model to ONNX: an attention call has "
                             f"dropout_p={dropout_p}: ONNX's Attention operator has no dropout, "
                             f"so the graph would not drop the weights mha drops; pass "
                             f"dropout_p=0.0 (or only while training) before exporting")
        if scale is not None and not scale > 0:
            raise ValueError(f"cannot export this model to ONNX: an attention call has "
                             f"scale={scale}: ONNX's Attention operator takes a scale > 0 "
                             f"(ONNX Runtime refuses to load the graph otherwise)")


def _check_exportable(model: nn.Module) -> None:
    """Refuse, with the reason, what a graph cannot reproduce."""
    from mha.module import MultiHeadAttention

    for name, m in model.named_modules():
        if not isinstance(m, MultiHeadAttention):
            continue
        where = f"module {name or type(model).__name__}"
        if m.training and m.dropout > 0:
            raise ValueError(f"{where} has dropout={m.dropout} and is in training mode: a graph "
                             f"would drop different weights than the model; call "
                             f"model.eval() before exporting")
        if m.tensor_parallel != 1:
            raise ValueError(f"{where} is split over {m.tensor_parallel} ranks "
                             f"(mha.distributed.tensor_parallel): export the unsplit module")
        for variant in ("softcap", "sinks"):
            if getattr(m, variant, None) is not None:
                raise ValueError(f"{where} uses {variant}: ONNX's Attention operator (and "
                                 f"SDPA) have no {variant}, so the graph cannot compute it")
