"""Choosing a backend: the first one in ``mha.backends.ORDER`` with no rejection reasons that
does not defer (a backend may leave a call it can serve to the next capable one, with a measured
reason; when every capable backend defers, the first capable one runs).

A forced backend is checked the same way; when it cannot serve, one error lists the inputs and
its reasons. :func:`explain` returns every backend's verdict in words.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mha import backends
from mha.backends.base import AttentionCall, Backend


@dataclass(frozen=True)
class Verdict:
    """One backend's answer to one call: ``ok`` when ``reasons`` is empty."""

    backend: str
    reasons: tuple[str, ...]
    chosen: bool = False
    defers: str | None = None  # can serve, but leaves the call to the next capable backend
    note: str | None = None  # can serve: how it would run, when worth saying (Backend.note)

    @property
    def ok(self) -> bool:
        return not self.reasons

    def __str__(self) -> str:
        mark = "chosen" if self.chosen else ("can serve" if self.ok else "rejected")
        note = f" ({self.note})" if self.ok and self.note else ""
        if self.ok and self.defers:
            return f"{self.backend:<10} {mark}{note}, defers: {self.defers}"
        tail = "" if self.ok else ": " + "; ".join(self.reasons)
        return f"{self.backend:<10} {mark}{note}{tail}"


class Explanation(list):
    """A list of :class:`Verdict`, one per backend, in dispatch order; prints as a table."""

    def __str__(self) -> str:
        return "\n".join(str(v) for v in self)

    @property
    def chosen(self) -> str | None:
        return next((v.backend for v in self if v.chosen), None)


class BackendError(ValueError):
    """No backend (or not the forced one) can serve a call; the message lists why."""


def verdicts(call: AttentionCall) -> Explanation:
    """Every backend's verdict on ``call``, the first capable one marked chosen."""
    rows = []
    for b in backends.all_backends():
        reasons = tuple(b.not_supported_reasons(call))
        ok = not reasons
        rows.append((b.name, reasons, b.defers(call) if ok else None, b.note(call) if ok else None))
    pick = next((n for n, r, d, _ in rows if not r and not d),
                next((n for n, r, _, _ in rows if not r), None))
    return Explanation(Verdict(n, r, n == pick, d, note) for n, r, d, note in rows)


_preferred: str | None = None  # set by use_backend (a plain global: torch.compile reads it)


@contextlib.contextmanager
def use_backend(name: str):
    """Within the block, every attention call that does not name a backend is forced to
    ``name`` (as if it passed ``backend=name``: a call it cannot serve raises
    :class:`BackendError` with the reasons). For a whole model at once — e.g. exporting a
    graph (``mha.export``) or comparing backends end to end. Process-wide while the block runs
    (blocks nest; the outer choice comes back on exit)."""
    global _preferred
    backends.get(name)  # an unknown name fails here, with the list of names
    outer, _preferred = _preferred, name
    try:
        yield
    finally:
        _preferred = outer


def choose(call: AttentionCall, backend: str | None = None) -> Backend:
    """The backend that will serve ``call``: ``backend`` if given and capable, else the first
    capable one. Raises :class:`BackendError` listing the reasons otherwise.

    In eager code each backend's capability-table verdict is cached by the call's
    :meth:`~mha.backends.base.AttentionCall.signature` (:meth:`Backend.rejects`); a trace
    (torch.compile, export) asks for the reasons themselves, as :func:`verdicts` does."""
    if backend is None:
        backend = _preferred
    signature = None if torch.compiler.is_compiling() else call.signature()
    if backend is not None:
        b = backends.get(backend)
        if b.rejects(call, signature):
            why = "; ".join(b.not_supported_reasons(call))  # one f-string: torch.compile /
            # strict export trace it
            raise BackendError(f"backend={backend!r} cannot serve this call ({call.describe()}): "
                               f"{why}. Pass backend=None to choose automatically, or see "
                               f"mha.explain(q, k, v, ...).")
        return b
    first = None
    for b in backends.all_backends():
        if not b.rejects(call, signature):
            if not b.defers(call):
                return b
            first = first or b
    if first is not None:
        return first
    table = "\n  ".join(str(v) for v in verdicts(call))
    raise BackendError(f"no backend can serve this call ({call.describe()}):\n  {table}")
