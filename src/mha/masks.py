"""Masks, with one polarity everywhere: **True = may attend**.

Shape legend: B batch, h query heads, Tq query length, Tk key length.

A call's masking is described by a small immutable :class:`MaskSpec` made of three parts
that all combine with AND:

* ``causal`` — query ``i`` may attend key ``j`` iff ``j <= i + (Tk - Tq)``: the causal
  diagonal is aligned to the **bottom right**, so the last query sees every key (what
  decoding needs). For ``Tq = 2, Tk = 5``::

        keys →  0 1 2 3 4
      q0        1 1 1 1 0
      q1        1 1 1 1 1

  and for ``Tq = 5, Tk = 2`` the first three query rows see nothing (they return zeros)::

      q0  0 0
      q1  0 0
      q2  0 0
      q3  1 0
      q4  1 1

* ``key_lengths`` ``(B,)`` — the number of real keys in each batch row; keys
  ``j >= key_lengths[b]`` are padding.
* ``mask`` — a bool tensor broadcastable to ``(B, h, Tq, Tk)``.
* ``mask_mod`` — a function of indices (:mod:`mha.mods`), materialized through its block plan
  (:mod:`mha.blockplan`).
* ``window`` (with ``causal``) — sliding-window attention: query ``i`` sees only the ``window``
  most recent keys up to its diagonal, ``i + (Tk - Tq) - window < j``. For ``Tq = Tk = 4``,
  ``window = 2``::

      q0  1 0 0 0
      q1  1 1 0 0
      q2  0 1 1 0
      q3  0 0 1 1

Backends either consume the parts natively (a kernel skipping blocks above the diagonal) or
ask for :meth:`MaskSpec.materialize`, the dense ``(B|1, h|1, Tq, Tk)`` bool tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mha.checks import check_int


def causal_mask(Tq: int, Tk: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The bottom-right aligned causal mask ``(Tq, Tk)``: True where query i may see key j.
    ``Tq`` and ``Tk`` are ints >= 0 (a ValueError / TypeError naming them otherwise)."""
    Tq = check_int("Tq", Tq, low=0, what="an int >= 0")
    Tk = check_int("Tk", Tk, low=0, what="an int >= 0")
    return _causal(Tq, Tk, device)


def _causal(Tq, Tk, device) -> torch.Tensor:
    """:func:`causal_mask` on sizes already known to be valid (symbolic sizes too, when a graph
    is traced for export)."""
    i = torch.arange(Tq, device=device).unsqueeze(1)  # (Tq, 1)
    j = torch.arange(Tk, device=device).unsqueeze(0)  # (1, Tk)
    return j <= i + (Tk - Tq)  # (Tq, Tk)


def window_mask(Tq: int, Tk: int, window: int, *,
                device: torch.device | str | None = None) -> torch.Tensor:
    """``(Tq, Tk)`` bool: True where key j is among the ``window`` most recent keys of query i's
    bottom-right diagonal, ``j > i + (Tk - Tq) - window`` (the left edge only; AND it with
    :func:`causal_mask`)."""
    i = torch.arange(Tq, device=device).unsqueeze(1)  # (Tq, 1)
    j = torch.arange(Tk, device=device).unsqueeze(0)  # (1, Tk)
    return j > i + (Tk - Tq) - window  # (Tq, Tk)


def lengths_mask(key_lengths: torch.Tensor, Tk: int) -> torch.Tensor:
    """``(B, 1, 1, Tk)`` bool: True for real keys ``j < key_lengths[b]``."""
    j = torch.arange(Tk, device=key_lengths.device)  # (Tk,)
    return (j.unsqueeze(0) < key_lengths.unsqueeze(1))[:, None, None, :]  # (B, 1, 1, Tk)


@dataclass(frozen=True)
class MaskSpec:
    """The masking of one attention call (see the module docstring). Immutable."""

    causal: bool = False
    key_lengths: torch.Tensor | None = None  # (B,) int64, 0 <= n <= Tk
    mask: torch.Tensor | None = None  # bool, 4-D view broadcastable to (B, h, Tq, Tk)
    window: int | None = None  # with causal: only the `window` most recent keys
    mask_mod: object = None  # (b, h, q_idx, kv_idx) -> bool tensor (mha.mods), via a block plan
    #: The mask kinds present, a subset of {"causal", "key_lengths", "mask", "window",
    #: "mask_mod"}.
    kinds: frozenset[str] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        kinds = frozenset((("causal",) if self.causal else ())
                          + (("key_lengths",) if self.key_lengths is not None else ())
                          + (("mask",) if self.mask is not None else ())
                          + (("window",) if self.window is not None else ())
                          + (("mask_mod",) if self.mask_mod is not None else ()))
        object.__setattr__(self, "kinds", kinds)

    @property
    def is_empty(self) -> bool:
        """True when nothing is masked (every query may attend every key)."""
        return not self.kinds

    def materialize(self, B: int, h: int, Tq: int, Tk: int,
                    device: torch.device | str | None = None) -> torch.Tensor | None:
        """The dense bool mask, broadcastable to ``(B, h, Tq, Tk)``; None when nothing is masked.

        Shapes are kept as small as the parts allow (e.g. ``(1, 1, Tq, Tk)`` for causal only).
        """
        if self.is_empty:
            return None
        allowed: torch.Tensor | None = None
        if self.causal:
            allowed = _causal(Tq, Tk, device)[None, None]  # (1, 1, Tq, Tk)
        if self.window is not None:
            wm = window_mask(Tq, Tk, self.window, device=device)[None, None]  # (1, 1, Tq, Tk)
            allowed = wm if allowed is None else allowed & wm
        if self.key_lengths is not None:
            lm = lengths_mask(self.key_lengths.to(device), Tk)  # (B, 1, 1, Tk)
            allowed = lm if allowed is None else allowed & lm
        if self.mask is not None:
            m = self.mask.to(device)
            allowed = m if allowed is None else allowed & m
        if self.mask_mod is not None:
            from mha.blockplan import block_plan  # plans build on masks' index functions

            mm = block_plan(self.mask_mod, B, h, Tq, Tk, device=device).materialize()
            allowed = mm if allowed is None else allowed & mm  # (B|1, h|1, Tq, Tk)
        return allowed

    def dense(self, B: int, h: int, Tq: int, Tk: int,
              device: torch.device | str | None = None) -> torch.Tensor:
        """The mask expanded to the full ``(B, h, Tq, Tk)`` (all True when nothing is masked)."""
        m = self.materialize(B, h, Tq, Tk, device)
        if m is None:
            return torch.ones(B, h, Tq, Tk, dtype=torch.bool, device=device)
        return m.expand(B, h, Tq, Tk)


def open_empty_rows(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Make fully masked query rows attend everything, and say which rows they were.

    Returns ``(allowed', row_has_key)`` where ``row_has_key`` is ``(.., Tq, 1)`` bool, or None
    when every row has a key. A backend softmaxes with ``allowed'`` (finite everywhere, so
    gradients stay finite) and multiplies its output by ``row_has_key`` to return zeros. While
    a graph is traced (torch.compile, export) the data-dependent shortcut is not taken.
    """
    row_has_key = allowed.any(dim=-1, keepdim=True)  # (.., Tq, 1)
    if not torch.compiler.is_compiling() and bool(row_has_key.all()):
        return allowed, None
    return allowed | ~row_has_key, row_has_key
