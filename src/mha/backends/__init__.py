"""The backends, one file each, in dispatch order (first capable backend wins).

Each module exposes ``BACKEND`` (a :class:`mha.backends.base.Backend`). ``flash_cpu`` is the
native kernel (``mha/csrc``); it is listed first and rejects calls it cannot serve, with reasons.
"""

from __future__ import annotations

import importlib

from mha.backends.base import AttentionCall, Backend, Capabilities

# Dispatch order. Each module is imported by name (``get``); none builds anything at import.
ORDER = ("flash_decode", "flash_cpu", "blocksparse", "sdpa", "math", "reference")

_loaded: dict[str, Backend] = {}


def get(name: str) -> Backend:
    """The backend called ``name`` (ValueError naming the known backends otherwise)."""
    if name not in ORDER:
        raise ValueError(f"backend: unknown backend {name!r}; known backends: {', '.join(ORDER)}")
    if name not in _loaded:
        _loaded[name] = importlib.import_module(f"mha.backends.{name}").BACKEND
    return _loaded[name]


_all: tuple[Backend, ...] = ()


def all_backends() -> tuple[Backend, ...]:
    """Every backend, in dispatch order (imported on the first call, then kept)."""
    global _all
    if len(_all) != len(ORDER):
        _all = tuple(get(n) for n in ORDER)
    return _all


__all__ = ["AttentionCall", "Backend", "Capabilities", "ORDER", "get", "all_backends"]


all_backends()  # import them now, outside any torch.compile trace (importlib cannot be traced)
