"""Mask and score functions of indices (``mask_mod`` / ``score_mod``), as FlexAttention writes them.

Shape legend: B batch, h query heads, Tq/Tk query/key lengths; n the key columns of one call.

* ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` — **True = may attend**.
* ``score_mod(score, b, h, q_idx, kv_idx) -> score`` — a new score, same shape.

Both are **vectorised**: they are called with broadcastable int64 index tensors ``b``
``(B|1, 1, 1, 1)``, ``h`` ``(1, h|1, 1, 1)``, ``q_idx`` ``(1, 1, rows, 1)``, ``kv_idx``
``(1, 1, 1, n)`` or, when several query blocks are evaluated at once, ``(1, 1, rows, n)`` (each
row its own keys); ``score`` has the broadcast shape of all four. They must use tensor ops
(``&``, ``|``, ``torch.where``, indexing a table by an index), not Python ``if``. A function
that ignores ``b`` or ``h`` gives a result of size 1 there; :func:`mha.block_plan` keeps it so.

The built-ins are aligned to the **bottom right**, like ``causal=True``: query row ``i`` sits at
position ``p = i + (Tk - Tq)``, so the last query is at the last key. They learn Tq and Tk when a
plan is built (``bind``); called directly, unbound, they assume Tq = Tk. For Tq=2, Tk=5,
``causal()`` is::

    1 1 1 1 0
    1 1 1 1 1

* :func:`causal` — ``kv <= p``.
* :func:`sliding_window` ``(w)`` — causal, and ``kv > p - w`` (the ``w`` most recent keys).
* :func:`document` ``(cu_seqlens=... | doc_ids=...)`` — query and key in the same document
  (bidirectional; AND it with :func:`causal` for causal documents).
* :func:`prefix_lm` ``(prefix_lengths)`` — ``kv < prefix[b]`` or ``kv <= p`` (per batch row).
* :func:`chunked` ``(size)`` — Llama 4's chunked attention: ``p // size == kv // size`` and
  causal.
* :func:`and_masks` / :func:`or_masks` — compositions.

The built-ins are hashable by their parameters (tensors by their contents), so a plan built for
``document(cu)`` is found again for an equal ``cu``; a custom function is keyed by its identity
and planned anew when a tensor it reads changed (:mod:`mha.blockplan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from mha.checks import check_int, check_int_tensor


class ModError(ValueError):
    """A ``mask_mod`` or ``score_mod`` raised, or returned the wrong kind of tensor; the message
    names the function and the block of indices it was called on."""


def check_mod(name: str, fn):
    """None or a callable (TypeError naming ``name`` otherwise)."""
    if fn is None or callable(fn):
        return fn
    sig = "(b, h, q_idx, kv_idx) -> bool" if name == "mask_mod" else \
        "(score, b, h, q_idx, kv_idx) -> score"
    raise TypeError(f"{name} must be a callable {sig}, got {type(fn).__name__}")


def _indices(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor):
    """Index tensors (1-D; kv_idx 1-D or ``(rows, n)``) -> the broadcastable 4-D views the
    functions are called with."""
    kv = kv_idx.view(1, 1, 1, -1) if kv_idx.dim() == 1 else kv_idx[None, None]  # (1, 1, 1|rows, n)
    return (b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1),  # (B|1, 1, 1, 1), (1, h|1, 1, 1)
            q_idx.view(1, 1, -1, 1), kv)  # (1, 1, rows, 1)


def _span(t: torch.Tensor) -> str:
    return "none" if t.numel() == 0 else f"{int(t.min())}..{int(t.max())}"


def where(q_idx: torch.Tensor, kv_idx: torch.Tensor, where_: str) -> str:
    """Words for the block a function was called on, for error messages."""
    return f"{where_} (q_idx {_span(q_idx)}, kv_idx {_span(kv_idx)})"


def eval_mask_mod(mod, b, h, q_idx, kv_idx, where_: str) -> torch.Tensor:
    """``mod`` on the block ``b x h x q_idx x kv_idx`` (1-D index tensors; kv_idx may be
    ``(rows, n)``): a bool tensor of 4 dims broadcastable to ``(len b, len h, rows, n)``.
    ModError otherwise."""
    args = _indices(b, h, q_idx, kv_idx)
    full = (b.numel(), h.numel(), q_idx.numel(), kv_idx.shape[-1])
    try:
        r = mod(*args)
    except Exception as e:  # noqa: BLE001 -- any error of user code, reported with its block
        raise ModError(f"mask_mod raised {type(e).__name__} on {where(q_idx, kv_idx, where_)}: "
                       f"{e}") from e
    if not isinstance(r, torch.Tensor) or r.dtype != torch.bool:
        got = r.dtype if isinstance(r, torch.Tensor) else type(r).__name__
        raise ModError(f"mask_mod must return a bool tensor (True = may attend), got {got} on "
                       f"{where(q_idx, kv_idx, where_)}; compare, e.g. `kv_idx <= q_idx`")
    if r.layout != torch.strided or r.device != kv_idx.device:
        raise ModError(f"mask_mod must return a dense bool tensor on the indices' device, got "
                       f"layout {r.layout} on {r.device}, not on {kv_idx.device}, on "
                       f"{where(q_idx, kv_idx, where_)}")
    if r.dim() > 4 or any(g not in (1, w) for g, w in
                          zip((1,) * (4 - r.dim()) + tuple(r.shape), full, strict=True)):
        raise ModError(f"mask_mod returned shape {tuple(r.shape)}, not broadcastable to "
                       f"(B, h, rows, cols) = {full} on {where(q_idx, kv_idx, where_)}")
    return r.reshape((1,) * (4 - r.dim()) + tuple(r.shape))  # (B|1, h|1, rows|1, n|1)


def apply_score_mod(fn, score: torch.Tensor, b, h, q_idx, kv_idx, where_: str) -> torch.Tensor:
    """``fn(score, ...)`` on one block of scores ``(B|1, h|1, rows, n)``; ModError when it
    raises, returns something other than a floating tensor, or changes the shape."""
    args = _indices(b, h, q_idx, kv_idx)
    try:
        r = fn(score, *args)
    except Exception as e:  # noqa: BLE001 -- any error of user code, reported with its block
        raise ModError(f"score_mod raised {type(e).__name__} on {where(q_idx, kv_idx, where_)}: "
                       f"{e}") from e
    if not isinstance(r, torch.Tensor) or not r.dtype.is_floating_point:
        got = r.dtype if isinstance(r, torch.Tensor) else type(r).__name__
        raise ModError(f"score_mod must return a floating tensor, got {got} on "
                       f"{where(q_idx, kv_idx, where_)}")
    if r.shape != score.shape:
        raise ModError(f"score_mod must return the score's shape {tuple(score.shape)}, got "
                       f"{tuple(r.shape)} on {where(q_idx, kv_idx, where_)}")
    return r.to(score.dtype)


def bind(mod, B: int, Tq: int, Tk: int):
    """The function a plan evaluates: built-ins learn the sizes; custom functions are as given."""
    return mod.bind(B, Tq, Tk) if isinstance(mod, _Mod) else mod


class _Mod:
    """A built-in: a frozen dataclass (hashable by parameters) with ``bind`` and ``__call__``."""

    offset: int  # Tk - Tq once bound

    def bind(self, B: int, Tq: int, Tk: int):
        return replace(self, offset=Tk - Tq)


def _table(values, name: str, expected: str):
    """An integer tensor (or list) as nested tuples (an int when 0-d): hashable by contents."""
    def tup(x):
        return tuple(tup(y) for y in x) if isinstance(x, list) else x
    return tup(check_int_tensor(name, values, expected).to(torch.int64).cpu().tolist())


@dataclass(frozen=True)
class _Causal(_Mod):
    offset: int = 0

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + self.offset


@dataclass(frozen=True)
class _Window(_Mod):
    w: int
    offset: int = 0

    def __call__(self, b, h, q_idx, kv_idx):
        p = q_idx + self.offset
        return (kv_idx <= p) & (kv_idx > p - self.w)


@dataclass(frozen=True)
class _Chunked(_Mod):
    size: int
    offset: int = 0

    def __call__(self, b, h, q_idx, kv_idx):
        p = q_idx + self.offset
        return (kv_idx <= p) & (torch.div(p, self.size, rounding_mode="floor")
                                == torch.div(kv_idx, self.size, rounding_mode="floor"))


@dataclass(frozen=True)
class _Document(_Mod):
    ids: tuple  # (T,) or (B, T) document id per position
    offset: int = 0
    _t: torch.Tensor = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_t", torch.tensor(self.ids, dtype=torch.int64))

    def bind(self, B: int, Tq: int, Tk: int):
        T = self._t.shape[-1]
        if T != Tk or (self._t.dim() == 2 and self._t.shape[0] not in (1, B)):
            raise ValueError(f"document: the document ids cover shape {tuple(self._t.shape)}, "
                             f"expected (Tk,) = ({Tk},) or (B, Tk) = ({B}, {Tk}) (one id per key)")
        return super().bind(B, Tq, Tk)

    def __call__(self, b, h, q_idx, kv_idx):
        t = self._t.to(kv_idx.device)
        p = q_idx + self.offset  # query positions; < 0 before the first key (sees no document)
        if t.dim() == 1:
            return (t[p.clamp(min=0)] == t[kv_idx]) & (p >= 0)
        bb = b.clamp(max=t.shape[0] - 1)
        return (t[bb, p.clamp(min=0)] == t[bb, kv_idx]) & (p >= 0)


@dataclass(frozen=True)
class _PrefixLM(_Mod):
    prefix: tuple | int  # (B,), or one length for every row
    offset: int = 0
    _t: torch.Tensor = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_t", torch.tensor(self.prefix, dtype=torch.int64))

    def bind(self, B: int, Tq: int, Tk: int):
        if self._t.dim() == 1 and self._t.shape[0] != B:
            raise ValueError(f"prefix_lm: prefix_lengths must have shape (B,) = ({B},), got "
                             f"{tuple(self._t.shape)}")
        return super().bind(B, Tq, Tk)

    def __call__(self, b, h, q_idx, kv_idx):
        t = self._t.to(kv_idx.device)
        n = t if t.dim() == 0 else t[b]  # () or (B, 1, 1, 1)
        return (kv_idx < n) | (kv_idx <= q_idx + self.offset)


@dataclass(frozen=True)
class _Combine(_Mod):
    op: str  # "and" / "or"
    mods: tuple

    def bind(self, B: int, Tq: int, Tk: int):
        return replace(self, mods=tuple(bind(m, B, Tq, Tk) for m in self.mods))

    def __call__(self, b, h, q_idx, kv_idx):
        out = None
        for m in self.mods:
            r = m(b, h, q_idx, kv_idx)
            out = r if out is None else (out & r if self.op == "and" else out | r)
        return out


def causal():
    """Causal, bottom-right aligned like ``causal=True``: ``kv_idx <= q_idx + Tk - Tq``."""
    return _Causal()


def sliding_window(w: int):
    """The ``w`` most recent keys up to the (bottom-right) diagonal, as ``causal=True,
    window=w``: ``p - w < kv_idx <= p``."""
    return _Window(check_int("sliding_window: w", w, low=1, what="a positive int"))


def chunked(size: int):
    """Llama 4's chunked attention: query position ``p`` and key ``kv_idx`` in the same chunk of
    ``size`` positions, and ``kv_idx <= p``."""
    return _Chunked(check_int("chunked: size", size, low=1, what="a positive int"))


def document(*, cu_seqlens=None, doc_ids=None):
    """Attention within documents (packed sequences): exactly one of

    * ``cu_seqlens`` ``(S + 1,)`` — offsets ``0 = c_0 <= ... <= c_S = Tk``;
    * ``doc_ids`` ``(Tk,)`` or ``(B, Tk)`` — an integer document id per key position.

    Query row ``i`` belongs to the document of position ``i + Tk - Tq``. Not causal: combine
    with ``and_masks(document(...), causal())`` for causal documents.
    """
    if (cu_seqlens is None) == (doc_ids is None):
        raise ValueError("document: pass exactly one of cu_seqlens=(S + 1,) offsets or "
                         "doc_ids=(Tk,) / (B, Tk) ids")
    if doc_ids is not None:
        ids = _table(doc_ids, "document: doc_ids", "(Tk,) or (B, Tk)")
        t = torch.tensor(ids)
        if t.dim() not in (1, 2):
            raise ValueError(f"document: doc_ids must have shape (Tk,) or (B, Tk), got "
                             f"{tuple(t.shape)}")
        return _Document(ids)
    cu = torch.tensor(_table(cu_seqlens, "document: cu_seqlens", "(S + 1,)"))
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"document: cu_seqlens must be 1-D, start at 0 and never decrease, "
                         f"got {cu.tolist()[:12]}")
    lengths = cu[1:] - cu[:-1]  # (S,)
    ids = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)  # (Tk,)
    return _Document(tuple(ids.tolist()))


def prefix_lm(prefix_lengths):
    """Prefix-LM: every query sees the first ``prefix_lengths[b]`` keys of its batch row
    (bidirectional prefix), and the rest causally. ``prefix_lengths``: an int, or ``(B,)``."""
    if isinstance(prefix_lengths, int) and not isinstance(prefix_lengths, bool):
        return _PrefixLM(check_int("prefix_lm: prefix_lengths", prefix_lengths, low=0,
                                   what="an int >= 0 or a (B,) integer tensor"))
    t = _table(prefix_lengths, "prefix_lm: prefix_lengths", "(B,)")
    if isinstance(t, int):
        return prefix_lm(t)
    if any(not isinstance(n, int) for n in t):
        raise ValueError(f"prefix_lm: prefix_lengths must have shape (B,), got "
                         f"{tuple(torch.tensor(t).shape)}")
    if any(n < 0 for n in t):
        raise ValueError(f"prefix_lm: prefix_lengths must be >= 0, got {list(t)[:12]}")
    return _PrefixLM(t)


def _check_mods(name: str, mods) -> tuple:
    if not mods:
        raise ValueError(f"{name}: pass at least one mask_mod")
    for m in mods:
        check_mod(f"{name}: each mask_mod", m)
    return tuple(mods)


def and_masks(*mods):
    """A mask_mod that attends where every one of ``mods`` does."""
    return _Combine("and", _check_mods("and_masks", mods))


def or_masks(*mods):
    """A mask_mod that attends where any one of ``mods`` does."""
    return _Combine("or", _check_mods("or_masks", mods))


@dataclass(frozen=True)
class _Everything(_Mod):
    """Every pair (the plan of a call with a score_mod and no mask function: all FULL)."""

    offset: int = 0

    def __call__(self, b, h, q_idx, kv_idx):
        return torch.ones((), dtype=torch.bool, device=kv_idx.device).expand(
            q_idx.shape[2], kv_idx.shape[3])


def for_call(mask_mod, causal: bool, window: int | None):
    """The one mask function a call's plan is built from: ``mask_mod`` AND ``causal`` AND
    ``window`` (the index-only parts of a call's masks; tensors are ANDed per block)."""
    parts = [] if mask_mod is None else [mask_mod]
    if causal:
        parts.append(_Causal() if window is None else _Window(window))
    if not parts:
        return _Everything()
    return parts[0] if len(parts) == 1 else _Combine("and", tuple(parts))
