"""Shape traces recorded from a real run (seed 004's flow table, measured, not typed in).

``mha.trace(module, x)`` runs the module once and returns the steps it took, each with the
formula in the seeds' notation and the shape of the tensor that step actually produced.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass

import torch

_ACTIVE: list[Trace] = []


@dataclass(frozen=True)
class Step:
    """One recorded step: its name, its formula, and the tensor shape it produced."""

    step: str
    formula: str
    shape: tuple[int, ...]
    dtype: str
    legend: str = ""  # the shape in the seeds' letters, e.g. "(B, h, T, d_k)"


class Trace(list):
    """The recorded steps of one run (a list of :class:`Step`)."""

    backend: str | None = None

    def to_dict(self) -> dict:
        return {"backend": self.backend, "steps": [asdict(s) | {"shape": list(s.shape)}
                                                   for s in self]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self, title: str = "Multi-head attention, shapes recorded from the run"):
        """A rich Table: step, formula, symbolic shape, recorded shape."""
        from rich.table import Table

        t = Table(title=title)
        for col in ("#", "step", "formula", "shape (seeds' letters)", "recorded shape", "dtype"):
            t.add_column(col)
        for i, s in enumerate(self, 1):
            t.add_row(str(i), s.step, s.formula, s.legend, str(list(s.shape)), s.dtype)
        return t


class Recorder:
    """Appends steps to one trace. :func:`recorder` hands one to a module while a trace is
    being recorded; the module calls :meth:`record` after each step it takes."""

    on = True

    def __init__(self, steps: Trace) -> None:
        self._steps = steps

    def record(self, step: str, formula: str, tensor: torch.Tensor, legend: str = "") -> None:
        self._steps.append(Step(step, formula, tuple(tensor.shape),
                                str(tensor.dtype).replace("torch.", ""), legend))


class NullRecorder:
    """The recorder while no trace is active: :meth:`record` does nothing."""

    on = False

    def record(self, step: str, formula: str, tensor: torch.Tensor, legend: str = "") -> None:
        pass


_NULL = NullRecorder()


def recorder() -> Recorder | NullRecorder:
    """A recorder for the innermost active trace, or the null recorder when none is active.
    ``recorder().on`` says which (a module asks for attention weights only when it is on)."""
    return Recorder(_ACTIVE[-1]) if _ACTIVE else _NULL


def active() -> bool:
    """True while a trace is being recorded (modules check this before recording)."""
    return bool(_ACTIVE)


def record(step: str, formula: str, tensor: torch.Tensor, legend: str = "") -> None:
    """Append a step to the innermost active trace (a no-op when none is active)."""
    recorder().record(step, formula, tensor, legend)


def set_backend(name: str) -> None:
    if _ACTIVE:
        _ACTIVE[-1].backend = name


@contextlib.contextmanager
def recording():
    """Record every step of the mha modules run inside the ``with`` block."""
    tr = Trace()
    _ACTIVE.append(tr)
    try:
        yield tr
    finally:
        _ACTIVE.pop()


def trace(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor | None = None,
          value: torch.Tensor | None = None, **kwargs) -> Trace:
    """Run ``module(query, key, value, need_weights=True, **kwargs)`` once and return its steps."""
    if not callable(module):
        raise TypeError(f"module must be an mha module to run (e.g. mha.MultiHeadAttention), got "
                        f"{type(module).__name__}")
    if "need_weights" in kwargs:
        raise TypeError("trace: need_weights is set by trace (it records the attention weights), "
                        "not an argument")
    if kwargs.get("cu_seqlens") is not None:
        raise ValueError("trace: the steps include the attention weights, and packed sequences "
                         "(cu_seqlens) return none; trace one sequence at a time")
    with torch.no_grad(), recording() as tr:
        module(query, key, value, need_weights=True, **kwargs)
    return tr
