"""Saving and loading modules with safetensors: weights plus the constructor arguments as
metadata. Nothing is ever unpickled, so loading an untrusted file cannot run code.

Loading trusts nothing in the file: the metadata is parsed strictly (each field's JSON type,
sizes positive and no larger than the file's tensors), the expected tensor names, shapes and
dtypes are derived from it on the meta device (no memory), and only a file whose header
matches exactly is read and built into a module — so the module never holds more than the file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from mha.checks import check_device, check_float_dtype, check_path
from mha.module import MultiHeadAttention
from mha.rope import Rotary

_CONFIG_KEY = "mha.MultiHeadAttention"
_SIZE_FIELDS = ("d_model", "num_heads", "num_kv_heads", "head_dim", "v_head_dim", "kdim", "vdim")
_FIELDS = (*_SIZE_FIELDS, "bias", "dropout")
#: Score-variant and rotary-embedding options, written by save and optional when read (files
#: written before them hold none): their values when absent.
_OPTIONAL = {"softcap": None, "sinks": False, "alibi": False, "rope": None}
#: the fields of the "rope" object (null: no rotary embeddings), :class:`mha.rope.Rotary`'s.
_ROPE_FIELDS = ("dim", "theta", "interleaved", "scaling")
#: safetensors dtype codes of the floating dtypes a module may be saved in.
_FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16,
                "F16": torch.float16}


def config(m: MultiHeadAttention) -> dict:
    """The constructor arguments that rebuild ``m`` (derived from the module, not stored)."""
    return dict(d_model=m.d_model, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                head_dim=m.head_dim, v_head_dim=m.v_head_dim, kdim=m.kdim, vdim=m.vdim,
                bias=m.out_proj.bias is not None, dropout=m.dropout, softcap=m.softcap,
                sinks=m.sinks is not None, alibi=m.alibi_slopes is not None,
                rope=None if m.rope is None else _rope_config(m.rope))


def _rope_config(rope: Rotary) -> dict:
    """``rope``'s settings as JSON: ``scaling`` null or its ``rope_parameters`` dict."""
    return dict(dim=rope.dim, theta=rope.theta, interleaved=rope.interleaved,
                scaling=None if rope.scaling is None else dict(rope.scaling))


def save(m: MultiHeadAttention, path: str | Path) -> None:
    """Write ``m``'s weights and configuration to a ``.safetensors`` file."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    if not isinstance(m, MultiHeadAttention):
        raise TypeError(f"m must be an mha.MultiHeadAttention, got {type(m).__name__}")
    if m.tensor_parallel != 1:
        raise ValueError(f"m is split over {m.tensor_parallel} ranks "
                         f"(mha.distributed.tensor_parallel) and holds this rank's heads only; "
                         f"save the module before splitting it")
    names = ("in_proj" if m.packed else "q_proj", *(() if m.packed else ("k_proj", "v_proj")),
             "out_proj")
    missing = [n for n in names if getattr(m, n).bias is None]
    if 0 < len(missing) < len(names):
        kept = [n for n in names if n not in missing]
        raise ValueError(f"m: {', '.join(n + '.bias' for n in missing)} is None while "
                         f"{', '.join(n + '.bias' for n in kept)} is not: the file stores one "
                         f"bias flag for all projections (set the missing biases to zeros, "
                         f"which computes the same)")
    path = check_path("path", path)
    if path.is_dir():
        raise ValueError(f"path {str(path)!r} is a directory; give a file name in it")
    if not path.parent.is_dir():
        raise ValueError(f"path {str(path)!r}: its directory {str(path.parent)!r} does not exist")
    tensors = {k: v.detach().contiguous() for k, v in m.state_dict().items()}
    try:
        save_file(tensors, str(path), metadata={_CONFIG_KEY: json.dumps(config(m))})
    except SafetensorError as e:  # e.g. a read-only directory (safetensors writes aside first)
        raise OSError(f"{path}: cannot be written ({e})") from None


def load(path: str | Path, *, device=None, dtype=None) -> MultiHeadAttention:
    """Rebuild the module saved by :func:`save`, in ``dtype`` on ``device``; ``dtype=None``
    keeps the file's (that of its tensors when they share one, else torch's default dtype).

    Raises ValueError naming the file and the field or tensor at fault when the file is not a
    safetensors file (or is truncated), holds no mha configuration, or its configuration and
    tensors disagree; no module is built before all of that has been checked.
    """
    from safetensors import SafetensorError, safe_open

    dtype = check_float_dtype("dtype", dtype)
    device = check_device("device", device)
    path = check_path("path", path)
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a safetensors file")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                      for name in f.keys()}
            cfg = _parse_config(path, f.metadata() or {}, header)
            _check_tensors(path, cfg, header)
            state = {name: f.get_tensor(name) for name in header}
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    if dtype is None:
        saved = {code for _, code in header.values()}
        dtype = _FILE_DTYPES[saved.pop()] if len(saved) == 1 else None
    m = MultiHeadAttention(**cfg, device=device, dtype=dtype)
    m.load_state_dict(state)
    return m


def _parse_config(path, meta: dict, header: dict) -> dict:
    """The constructor arguments stored in ``meta``, each field's type and range checked; sizes
    are bounded by the largest dimension of the file's (non-empty) tensors."""
    if _CONFIG_KEY not in meta:
        raise ValueError(f"{path}: not an mha.MultiHeadAttention file (no '{_CONFIG_KEY}' "
                         f"metadata; found keys {sorted(meta)})")
    try:
        cfg = json.loads(meta[_CONFIG_KEY])
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: metadata '{_CONFIG_KEY}' is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: metadata '{_CONFIG_KEY}' must be a JSON object of the fields "
                         f"{list(_FIELDS)}, got {type(cfg).__name__}")
    missing = sorted(set(_FIELDS) - set(cfg))
    unknown = sorted(set(cfg) - set(_FIELDS) - set(_OPTIONAL))
    if missing or unknown:
        raise ValueError(f"{path}: metadata '{_CONFIG_KEY}' must hold exactly the fields "
                         f"{list(_FIELDS)} (and optionally {list(_OPTIONAL)}); missing "
                         f"{missing}, unknown {unknown}")
    cfg = {**_OPTIONAL, **cfg}
    largest = max((max(shape) for shape, _ in header.values() if math.prod(shape) > 0), default=0)
    for name in _SIZE_FIELDS:
        value = cfg[name]
        if type(value) is not int:  # JSON true/false arrive as bool, 4.0 as float: refused
            raise ValueError(f"{path}: metadata field '{name}' must be a JSON integer, got "
                             f"{json.dumps(value)[:40]}")
        if not 1 <= value <= largest:
            raise ValueError(f"{path}: metadata field '{name}' must lie in [1, {largest}] (the "
                             f"largest dimension of the file's tensors), got {value}")
    if type(cfg["bias"]) is not bool:
        raise ValueError(f"{path}: metadata field 'bias' must be a JSON bool (true or false), "
                         f"got {json.dumps(cfg['bias'])[:40]}")
    dropout = cfg["dropout"]
    if type(dropout) not in (int, float) or not 0.0 <= dropout < 1.0:  # NaN fails the range
        raise ValueError(f"{path}: metadata field 'dropout' must be a number in [0, 1), got "
                         f"{json.dumps(dropout)[:40]}")
    softcap = cfg["softcap"]
    if softcap is not None and (type(softcap) not in (int, float) or not 0.0 < softcap < math.inf):
        raise ValueError(f"{path}: metadata field 'softcap' must be null or a positive finite "
                         f"number, got {json.dumps(softcap)[:40]}")
    for name in ("sinks", "alibi"):
        if type(cfg[name]) is not bool:
            raise ValueError(f"{path}: metadata field '{name}' must be a JSON bool (true or "
                             f"false), got {json.dumps(cfg[name])[:40]}")
    cfg["rope"] = _parse_rope(path, cfg["rope"])
    return cfg


def _parse_rope(path, rope) -> Rotary | None:
    """The ``rope`` field: null, or an object of exactly :data:`_ROPE_FIELDS` that builds a
    :class:`mha.rope.Rotary` (JSON types checked first: no bool for a number)."""
    if rope is None:
        return None
    if not isinstance(rope, dict):
        raise ValueError(f"{path}: metadata field 'rope' must be null or a JSON object of "
                         f"{list(_ROPE_FIELDS)}, got {json.dumps(rope)[:40]}")
    missing = sorted(set(_ROPE_FIELDS) - set(rope))
    unknown = sorted(set(rope) - set(_ROPE_FIELDS))
    if missing or unknown:
        raise ValueError(f"{path}: metadata field 'rope' must hold exactly {list(_ROPE_FIELDS)}; "
                         f"missing {missing}, unknown {unknown}")
    scaling = rope["scaling"]
    numbers = {"dim": rope["dim"], "theta": rope["theta"],
               **({} if not isinstance(scaling, dict) else
                  {f"scaling.{k}": v for k, v in scaling.items() if k not in ("rope_type", "type")})}
    for name, value in numbers.items():
        if type(value) not in (int, float):
            raise ValueError(f"{path}: metadata field 'rope': {name} must be a JSON number, got "
                             f"{json.dumps(value)[:40]}")
    try:
        return Rotary(rope["dim"], theta=rope["theta"], interleaved=rope["interleaved"],
                      scaling=scaling)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: metadata field 'rope': {e}") from None


def _check_tensors(path, cfg: dict, header: dict) -> None:
    """The file's tensors are exactly the state dict of the module ``cfg`` describes (names and
    shapes, read off a module built on the meta device), in floating dtypes."""
    try:
        expected = {k: tuple(t.shape) for k, t in
                    MultiHeadAttention(**cfg, device="meta").state_dict().items()}
    except (ValueError, TypeError, RuntimeError) as e:  # inconsistent or overflowing sizes
        raise ValueError(f"{path}: metadata '{_CONFIG_KEY}' describes no valid module ({e})") \
            from None
    missing, unknown = sorted(set(expected) - set(header)), sorted(set(header) - set(expected))
    if missing or unknown:
        raise ValueError(f"{path}: the tensors must be exactly {sorted(expected)} for this "
                         f"configuration; missing {missing}, unknown {unknown}")
    for name, want in expected.items():
        shape, code = header[name]
        if shape != want:
            raise ValueError(f"{path}: tensor '{name}' must have shape {want} for the "
                             f"configuration {cfg}, got {shape}")
        if code not in _FILE_DTYPES:
            raise ValueError(f"{path}: tensor '{name}' must be floating "
                             f"({', '.join(_FILE_DTYPES)}), got {code}")
