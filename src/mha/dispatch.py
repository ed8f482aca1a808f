"""Choosing a backend: the first one in ``mha.backends.ORDER`` with no rejection reasons.

A forced backend is checked the same way; when it cannot serve, one error lists the inputs and
its reasons. :func:`explain` returns every backend's verdict in words.
"""

from __future__ import annotations

from dataclasses import dataclass

from mha import backends
from mha.backends.base import AttentionCall, Backend


@dataclass(frozen=True)
class Verdict:
    """One backend's answer to one call: ``ok`` when ``reasons`` is empty."""

    backend: str
    reasons: tuple[str, ...]
    chosen: bool = False

    @property
    def ok(self) -> bool:
        return not self.reasons

    def __str__(self) -> str:
        mark = "chosen" if self.chosen else ("can serve" if self.ok else "rejected")
        tail = "" if self.ok else ": " + "; ".join(self.reasons)
        return f"{self.backend:<10} {mark}{tail}"


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
    out = Explanation()
    chosen = False
    for b in backends.all_backends():
        reasons = tuple(b.not_supported_reasons(call))
        pick = not reasons and not chosen
        chosen = chosen or pick
        out.append(Verdict(b.name, reasons, pick))
    return out


def choose(call: AttentionCall, backend: str | None = None) -> Backend:
    """The backend that will serve ``call``: ``backend`` if given and capable, else the first
    capable one. Raises :class:`BackendError` listing the reasons otherwise."""
    if backend is not None:
        b = backends.get(backend)
        reasons = b.not_supported_reasons(call)
        if reasons:
            raise BackendError(f"backend={backend!r} cannot serve this call ({call.describe()}): "
                               + "; ".join(reasons) + ". Pass backend=None to choose automatically, "
                               "or see mha.explain(q, k, v, ...).")
        return b
    for b in backends.all_backends():
        if not b.not_supported_reasons(call):
            return b
    table = "\n  ".join(str(v) for v in verdicts(call))
    raise BackendError(f"no backend can serve this call ({call.describe()}):\n  {table}")
