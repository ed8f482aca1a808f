"""Backend ``flash_cpu``: the native CPU kernel (``mha/csrc``). Being written (issue 3)."""

from __future__ import annotations

import torch

from mha.backends.base import Backend, Capabilities


def _forward(call):
    raise RuntimeError("flash_cpu is not available")


BACKEND = Backend(
    name="flash_cpu",
    summary="native flash-attention kernel for the CPU (AVX-512 / AVX512_BF16)",
    caps=Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32, torch.bfloat16})),
    forward=_forward,
    unavailable=lambda: "native kernel not built in this version",
)
