"""Sizes that may be symbolic: while ``torch.compile`` or ``torch.export`` traces, a length or
batch is a ``SymInt``, and every Python comparison of it becomes a guard (a condition under
which the traced graph is valid). :func:`size_below` is how the size rules of dispatch, the
backends and the projections compare one with a threshold.
"""

from __future__ import annotations

import torch


def size_below(size, limit: int, *, unsettled: bool) -> bool:
    """``size < limit`` for a size a rule compares with a threshold (a backend's Tq / Tk, the
    projections' rows).

    In eager code and under ``torch.compile`` the plain comparison: torch.compile guards on it
    and traces again when a size crosses the threshold. Under ``torch.export`` a dynamic size
    is a range the program must serve whole, and a guard on the threshold would narrow it
    (torch then refuses the requested range); a comparison the declared range does not settle
    therefore answers ``unsettled`` without a guard, and the rule picks the side that serves
    every size in the range."""
    if not torch.compiler.is_exporting():
        return size < limit
    # (no isinstance(size, int) shortcut: under strict export dynamo answers it True for a
    # symbolic size; statically_known_true settles plain ints too)
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if statically_known_true(size < limit):
        return True
    if statically_known_true(size >= limit):
        return False
    return unsettled
