"""Validation at the boundary: small ``check_*`` helpers whose errors name the argument, the
expected shape in the seeds' notation and what was received.

Shape legend: B batch, h query heads, h_kv key/value heads, Tq/Tk lengths, d_k/d_v head dims.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
from pathlib import Path

import torch

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def check_tensor(name: str, t, ndim: int, expected: str) -> None:
    """``t`` is a floating tensor of ``ndim`` dims (TypeError / ValueError otherwise)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {expected}, "
                        f"got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float32, bfloat16, float16, float64), "
                        f"got {t.dtype}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}; "
                        f"convert it with .to_dense()")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have shape {expected} ({ndim} dims), "
                         f"got {tuple(t.shape)} ({t.dim()} dims)")


def check_same(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    """All tensors share one dtype and one device."""
    first = tensors[0]
    dtype, device = first.dtype, first.device
    if all(t.dtype == dtype and t.device == device for t in tensors[1:]):
        return  # the common case, without building sets
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        got = ", ".join(f"{n}={t.dtype}" for n, t in zip(names, tensors, strict=True))
        raise TypeError(f"{', '.join(names)} must share one dtype, got {got}")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        got = ", ".join(f"{n} on {t.device}" for n, t in zip(names, tensors, strict=True))
        raise ValueError(f"{', '.join(names)} must be on one device, got {got}")


_FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES)


def _plain_qkv(q, k, v) -> tuple[int, ...] | None:
    """``(B, h, Tq, d_k, h_kv, Tk, d_v)`` when q, k, v are dense 4-D floating tensors of one
    dtype and one device with ``k (B, h_kv, Tk, d_k)``, ``v (B, h_kv, Tk, d_v)``, ``d_k >= 1``
    and ``h_kv | h``: every condition of :func:`check_qkv`, asked once each, with no message
    built (the common case); else None."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor)):
        return None
    dtype, strided = q.dtype, torch.strided
    if (dtype not in _FLOAT_DTYPE_SET or k.dtype != dtype or v.dtype != dtype
            or q.layout != strided or k.layout != strided or v.layout != strided
            or q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.device != k.device
            or q.device != v.device):
        return None
    B, h, Tq, d_k = q.shape
    kB, h_kv, Tk, kd = k.shape
    vB, vh, vT, d_v = v.shape
    if (d_k != 0 and kB == B and vB == B and kd == d_k and vh == h_kv and vT == Tk
            and h_kv != 0 and h % h_kv == 0):
        return B, h, Tq, d_k, h_kv, Tk, d_v
    return None


def qkv_sizes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """:func:`check_qkv`, then ``(B, h, Tq, d_k, h_kv, Tk, d_v)``."""
    sizes = _plain_qkv(q, k, v)
    if sizes is None:
        check_qkv(q, k, v)  # raises, naming what is wrong
        sizes = (*q.shape, k.shape[1], k.shape[2], v.shape[3])
    return sizes


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q ``(B, h, Tq, d_k)``, k ``(B, h_kv, Tk, d_k)``, v ``(B, h_kv, Tk, d_v)``, h_kv | h."""
    if _plain_qkv(q, k, v) is not None:
        return  # else the checks one by one, each with its message
    check_tensor("q", q, 4, "(B, h, Tq, d_k)")
    check_tensor("k", k, 4, "(B, h_kv, Tk, d_k)")
    check_tensor("v", v, 4, "(B, h_kv, Tk, d_v)")
    check_same(("q", "k", "v"), (q, k, v))
    B, h, _, d_k = q.shape
    kB, h_kv, Tk, kd = k.shape
    if d_k == 0:
        raise ValueError(f"q and k must have d_k >= 1 (the scores q k^T sum over d_k; the "
                         f"default scale is 1/sqrt(d_k)), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    vB, vh, vT, _ = v.shape
    if kB != B or vB != B:
        raise ValueError(f"q, k, v must share the batch size B: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if kd != d_k:
        raise ValueError(f"k must have shape (B, h_kv, Tk, d_k) with d_k={d_k} as in q "
                         f"(B, h, Tq, d_k) = {tuple(q.shape)}, got {tuple(k.shape)}")
    if vh != h_kv or vT != Tk:
        raise ValueError(f"k and v must have the same heads and length: k (B, h_kv, Tk, d_k) = "
                         f"{tuple(k.shape)}, v (B, h_kv, Tk, d_v) = {tuple(v.shape)}")
    _check_groups(h, h_kv, q, k)


def _check_groups(h: int, h_kv: int, q: torch.Tensor, k: torch.Tensor) -> None:
    """h_kv divides h: each K/V head serves h // h_kv query heads (GQA)."""
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"the query heads h={h} must be a multiple of the key/value heads "
                         f"h_kv={h_kv} (grouped-query attention): q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")


def check_packed_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Packed sequences: q ``(N_q, h, d_k)``, k ``(N_k, h_kv, d_k)``, v ``(N_k, h_kv, d_v)``,
    h_kv | h, d_k >= 1 — checked whole, even when there are no sequences to attend over."""
    check_tensor("q", q, 3, "(N_q, h, d_k)")
    check_tensor("k", k, 3, "(N_k, h_kv, d_k)")
    check_tensor("v", v, 3, "(N_k, h_kv, d_v)")
    check_same(("q", "k", "v"), (q, k, v))
    _, h, d_k = q.shape
    N_k, h_kv, kd = k.shape
    if kd != d_k or d_k == 0:
        raise ValueError(f"q (N_q, h, d_k) and k (N_k, h_kv, d_k) must share d_k >= 1, got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    if v.shape[:2] != (N_k, h_kv):
        raise ValueError(f"k (N_k, h_kv, d_k) and v (N_k, h_kv, d_v) must have the same tokens "
                         f"and heads, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    _check_groups(h, h_kv, q, k)


def check_mask(mask, B: int, h: int, Tq: int, Tk: int, device: torch.device) -> torch.Tensor:
    """A bool mask broadcastable to ``(B, h, Tq, Tk)``; returned as a 4-D view."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a bool torch.Tensor broadcastable to (B, h, Tq, Tk) = "
                        f"{(B, h, Tq, Tk)}, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = may attend), got {mask.dtype}; "
                        "convert an additive float mask with `mask = bias == 0`")
    if mask.layout != torch.strided:
        raise TypeError(f"mask must be a dense (strided) bool tensor, got layout {mask.layout}; "
                        f"convert it with .to_dense()")
    if mask.device != device:
        raise ValueError(f"mask must be on {device} like q, got {mask.device}")
    if mask.dim() > 4:
        raise ValueError(f"mask must be broadcastable to (B, h, Tq, Tk) = {(B, h, Tq, Tk)}, "
                         f"got {tuple(mask.shape)}")
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    for got, want in zip(m.shape, (B, h, Tq, Tk), strict=True):
        if got not in (1, want):
            raise ValueError(f"mask of shape {tuple(mask.shape)} is not broadcastable to "
                             f"(B, h, Tq, Tk) = {(B, h, Tq, Tk)}")
    return m


def check_int_tensor(name: str, value, expected: str, device=None) -> torch.Tensor:
    """A tensor of integers (a torch integer tensor, a numpy integer array or a list of ints);
    bool, floating and complex values are refused with a TypeError naming ``name``. Moved to
    ``device`` only when it is not a tensor already."""
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value, device=device)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"{name} must be an integer tensor {expected}; the "
                            f"{type(value).__name__} given does not convert to one ({e})") from None
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor {expected}, got {value.dtype}")
    return value


def check_readable(name: str, t: torch.Tensor) -> None:
    """``t``'s values can be read (checked against bounds): it is not a meta tensor, nor one
    batched by ``torch.vmap`` (which cannot branch on values)."""
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor: it holds no values to check, and no backend "
                         f"runs on the meta device; use tensors with data")
    if torch._C._functorch.is_batchedtensor(t):
        raise ValueError(f"{name} is batched by torch.vmap, but its values are checked before "
                         f"the call, which vmap cannot do; pass it unbatched (in_dims=None), or "
                         f"call mha without vmap: every argument takes a batch dim B already")


def check_key_lengths(key_lengths, B: int, Tk: int, device: torch.device) -> torch.Tensor:
    """An integer tensor ``(B,)`` with ``0 <= key_lengths[b] <= Tk``; returned as int64."""
    key_lengths = check_int_tensor("key_lengths", key_lengths, f"(B,) = ({B},)", device)
    if key_lengths.shape != (B,):
        raise ValueError(f"key_lengths must have shape (B,) = ({B},), got {tuple(key_lengths.shape)}")
    if key_lengths.device != device:
        raise ValueError(f"key_lengths must be on {device} like q, got {key_lengths.device}")
    if torch.compiler.is_compiling():  # a trace cannot branch on values: checked as it runs
        torch._assert_async(((key_lengths >= 0) & (key_lengths <= Tk)).all(),
                            f"key_lengths must lie in [0, Tk={Tk}]")
        return key_lengths.to(torch.int64)
    check_readable("key_lengths", key_lengths)
    if B and (int(key_lengths.min()) < 0 or int(key_lengths.max()) > Tk):
        raise ValueError(f"key_lengths must lie in [0, Tk={Tk}], got {key_lengths.tolist()}")
    return key_lengths.to(torch.int64)


def check_cu_seqlens(name: str, cu, total: int, device: torch.device) -> list[int]:
    """Packed-sequence offsets ``(S + 1,)``: integers, ``0 = c_0 <= ... <= c_S = total``.
    Returns the lengths ``[c_1 - c_0, ..., c_S - c_{S-1}]``."""
    cu = check_int_tensor(name, cu, "(S + 1,)")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must have shape (S + 1,) with S >= 0, got {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {cu.device}")
    check_readable(name, cu)
    offsets = cu.tolist()
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    if offsets[0] != 0 or offsets[-1] != total or any(n < 0 for n in lengths):
        raise ValueError(f"{name} must start at 0, never decrease and end at the token count "
                         f"{total}, got {offsets if len(offsets) <= 12 else offsets[:12] + ['...']}")
    return lengths


def check_window(window, causal: bool) -> int:
    """A sliding window: a positive int, used together with ``causal=True``."""
    window = check_int("window", window, what="a positive int (keys each query sees)")
    if window < 1:
        raise ValueError(f"window must be >= 1 (keys each query sees), got {window}")
    if not causal:
        raise ValueError("window is a sliding causal window: pass causal=True with it "
                         "(for other patterns pass a bool mask)")
    return window


# Scalars. Python's own types and numpy's scalars of the same kind are accepted (np.bool_ is a
# bool, np.integer an int, np.floating a real); 0-d tensors are refused with a hint, because
# reading one synchronizes with its device and silently drops its autograd graph.

def _numpy_bool(value) -> bool:
    np = sys.modules.get("numpy")  # a numpy scalar exists only if numpy was imported
    return np is not None and isinstance(value, np.bool_)


def _type_hint(value) -> str:
    if isinstance(value, torch.Tensor):
        return (f"a {value.dim()}-d {value.dtype} tensor (pass a Python number, e.g. "
                f"t.item(), if that is what you mean)")
    return type(value).__name__


def check_path(name: str, value) -> Path:
    """``value`` as a Path: a str or an os.PathLike (TypeError naming ``name`` otherwise)."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike (a file name), got "
                        f"{type(value).__name__}")
    return Path(value)


def check_bool(name: str, value) -> bool:
    """``True`` / ``False`` (or a numpy bool); anything else is a TypeError naming its type."""
    if isinstance(value, bool) or _numpy_bool(value):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False), got {_type_hint(value)}")


def check_text(name: str, text) -> str:
    """A str that is UTF-8 text, as tokenizers take it (TypeError / ValueError naming
    ``name``). Bytes that are not UTF-8 reach Python as lone surrogates (``surrogateescape``,
    how command lines and a C-locale stdin are decoded), which a tokenizer refuses with an
    error of its own."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"{text[e.start]!r}"
        raise ValueError(f"{name} must be UTF-8 text, got {what} at character {e.start}, "
                         f"which is not") from None
    return text


def check_int(name: str, value, *, low: int | None = None, what: str = "an int") -> int:
    """An integer (Python or numpy; not a bool), ``>= low`` when given; returned as int.
    ``what`` names the expectation in both errors, e.g. "a positive int" with ``low=1``."""
    if isinstance(value, bool) or _numpy_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {what}, got {_type_hint(value)}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be {what}, got {value}")
    return value


def check_scalar(name: str, value, *, low: float, high: float | None = None,
                 low_open: bool = False, high_open: bool = False) -> float:
    """A finite real number (Python or numpy; not a bool) in ``[low, high]`` (``(low, ...``
    when ``low_open``, ``..., high)`` when ``high_open``); returned as float."""
    if isinstance(value, bool) or _numpy_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {_type_hint(value)}")
    value = float(value)
    too_low = not (value > low if low_open else value >= low)  # NaN: too low
    too_high = high is not None and (value >= high if high_open else value > high)
    if not -math.inf < value < math.inf or too_low or too_high:
        bound = "" if high is None else (f", {high})" if high_open else f", {high}]")
        raise ValueError(f"{name} must lie in {'(' if low_open else '['}{low}"
                         f"{bound or ', inf)'} (a finite number), got {value}")
    return value


def check_device(name: str, device) -> torch.device | None:
    """None (the default device) or a device this build of torch can place tensors on (the
    meta device included); refused naming the argument, before any state is built."""
    if device is None:
        return None
    try:
        return torch.empty(0, device=device).device
    except (RuntimeError, AssertionError, TypeError, ValueError) as e:
        # e.g. "cuda:7" on a CPU build: torch raises AssertionError("Torch not compiled with
        # CUDA enabled") from deep inside the first allocation
        raise ValueError(f"{name}: {device!r} is not a device this torch can use "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                         ) from None


def check_float_dtype(name: str, dtype) -> torch.dtype | None:
    """None (the default dtype) or one of the floating dtypes attention computes in."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be None or a floating dtype (float32, bfloat16, float16, "
                        f"float64), got {dtype!r}")
    return dtype


# Score variants (mha.scores): each checked here, with errors naming the argument.

def check_softcap(value) -> float:
    """A finite real number > 0 (the cap of ``softcap * tanh(s / softcap)``)."""
    value = check_scalar("softcap", value, low=0.0)
    if value == 0.0:
        raise ValueError("softcap must be > 0 (scores are capped to (-softcap, softcap)), got 0.0; "
                         "pass softcap=None for no cap")
    return value


def _check_float_tensor(name: str, t, expected: str, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a floating torch.Tensor of shape {expected}, "
                        f"got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float32, bfloat16, float16, float64) "
                        f"of shape {expected}, got {t.dtype}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {t.device}")


def check_sinks(sinks, h: int, device: torch.device) -> torch.Tensor:
    """Attention sinks: one float logit per query head, ``(h,)``."""
    _check_float_tensor("sinks", sinks, f"(h,) = ({h},)", device)
    if tuple(sinks.shape) != (h,):
        raise ValueError(f"sinks must have shape (h,) = ({h},) (one logit per query head), "
                         f"got {tuple(sinks.shape)}")
    return sinks


def check_bias(bias, B: int, h: int, Tq: int, Tk: int, device: torch.device) -> torch.Tensor:
    """An additive float bias broadcastable to ``(B, h, Tq, Tk)``; returned as a 4-D view
    (never expanded)."""
    want = (B, h, Tq, Tk)
    _check_float_tensor("bias", bias, f"broadcastable to (B, h, Tq, Tk) = {want}", device)
    if bias.dim() > 4:
        raise ValueError(f"bias must be broadcastable to (B, h, Tq, Tk) = {want}, "
                         f"got {tuple(bias.shape)} ({bias.dim()} dims)")
    b = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))  # (..) -> 4-D view
    for got, n in zip(b.shape, want, strict=True):
        if got not in (1, n):
            raise ValueError(f"bias of shape {tuple(bias.shape)} is not broadcastable to "
                             f"(B, h, Tq, Tk) = {want}")
    return b


def check_alibi_slopes(slopes, B: int, h: int, device: torch.device) -> torch.Tensor:
    """ALiBi slopes ``(h,)`` or ``(B, h)``, finite floats; returned as ``(1|B, h)``."""
    exporting = getattr(torch.compiler, "is_exporting", lambda: False)()
    # under torch.export B may be a range: formatting it into the text would fix it (strict)
    want = f"(h,) = ({h},) or (B, h)" + ("" if exporting else f" = ({B}, {h})")
    _check_float_tensor("alibi_slopes", slopes, want, device)
    if tuple(slopes.shape) not in ((h,), (B, h)):
        raise ValueError(f"alibi_slopes must have shape {want}, got {tuple(slopes.shape)}; "
                         f"mha.alibi_slopes(h) gives the standard ones")
    if torch.compiler.is_compiling() and not exporting:  # checked as the compiled code runs
        torch._assert_async(torch.isfinite(slopes).all(), "alibi_slopes must be finite numbers")
    else:
        check_readable("alibi_slopes", slopes)
        if slopes.numel() and not exporting and not bool(torch.isfinite(slopes).all()):
            raise ValueError("alibi_slopes must be finite numbers")
    return slopes if slopes.dim() == 2 else slopes.unsqueeze(0)  # (h,) -> (1, h)


def check_eos_ids(eos_token_id, vocab_size: int, *, stops: str = "a request"
                  ) -> list[int] | None:
    """``eos_token_id``: None (no stop), a token id, or a non-empty list / tuple of them (as
    transformers' ``config.eos_token_id``: Llama-3-style models list several) -> None or the
    list of ids. Each must be an int in the vocabulary ``[0, vocab_size)`` (an id outside it
    could never stop ``stops``); refused naming the argument, or the list's item."""
    if eos_token_id is None:
        return None
    many = isinstance(eos_token_id, (list, tuple))
    if many and not eos_token_id:
        raise ValueError("eos_token_id must be a token id or a non-empty list of them, "
                         "got an empty list")
    ids = []
    for i, t in enumerate(eos_token_id if many else [eos_token_id]):
        name = f"eos_token_id[{i}]" if many else "eos_token_id"
        t = check_int(name, t, low=0, what="a token id (an int >= 0)")
        if t >= vocab_size:
            raise ValueError(f"{name} must be a token id of the model's vocabulary "
                             f"[0, {vocab_size}), got {t} (it could never stop {stops})")
        ids.append(t)
    return ids
