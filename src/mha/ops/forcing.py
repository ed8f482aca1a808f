"""The environment variables that force a kernel or a side, and the one rule for a value that
cannot be honoured.

``MHA_FLASH_BF16`` (the flash forward's bf16 tile kernel; the backward's products follow it),
``MHA_DECODE_BF16`` (the decode kernel's bf16 q.k) — both read by the C++ kernels
(``csrc/common/kernel_choice.h``: ``check_forced``) — ``MHA_LINEAR`` (the projections' side,
:mod:`mha.ops.linear_choice`) and ``MHA_AMX_EMULATE`` (software AMX tiles at build time,
:mod:`mha.ops.build`). The rule, the same words in C++ and here: an unknown value, or one this
build / CPU / OS cannot run, is refused with an error naming the variable, the value, the
choices and why (never a quiet fallback to another kernel):

    MHA_DECODE_BF16=amx cannot run here: no AMX tiles in this build: the CPU lacks amx_bf16
    (...) (choices this build can run: avx512bf16; unset it for the CPU's default)

A variable the kernels read refuses at every call that would read it (bf16 calls for the two
C++ ones), so fp32 work is unaffected; ``MHA_AMX_EMULATE`` refuses as a build failure (the
reason in ``mha build``, ``mha.explain`` and one warning). ``MHA_TEST_AMX_REFUSED=1`` is not a
choice but a test seam: a build with AMX tiles acts as if the OS refused the tile state.
Work whose record names the kernels (``mha bench``) checks every variable set before it
starts (``mha.cli.bench.check_forcing``: this module imports no kernel).
"""

from __future__ import annotations

import functools
from pathlib import Path

VARIABLES = ("MHA_FLASH_BF16", "MHA_DECODE_BF16", "MHA_LINEAR", "MHA_AMX_EMULATE")


def refusal(var: str, value: str, choices: dict[str, str | None], default: str) -> str | None:
    """The error message for ``var=value``, or None when it can run. ``choices``: each value
    and why this build / CPU cannot run it (None when it can); ``default``: what unset means."""
    here = ", ".join(c for c, why in choices.items() if why is None) or "none"
    if value not in choices:
        return (f"{var}={value} is not a choice: expected one of {', '.join(choices)} "
                f"(this build can run: {here}; unset it for {default})")
    why = choices[value]
    if why is None:
        return None
    return (f"{var}={value} cannot run here: {why} (choices this build can run: {here}; "
            f"unset it for {default})")


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` is such a refusal (the CLI shows it as one line, no traceback)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return first.startswith(tuple(f"{v}=" for v in VARIABLES))


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first processor's flags in ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


EMULATION_FLAGS = ("avx512f", "avx512_bf16")  # what the software tiles need


def amx_emulate(value: str | None, flags: frozenset[str] | None = None) -> bool:
    """``MHA_AMX_EMULATE``: True for ``1`` (software AMX tiles), False unset / empty / ``0``.
    Raises ValueError (the rule's words) for another value, or for ``1`` on a CPU without
    AVX-512F and AVX512_BF16 (the software tiles are built on them)."""
    value = (value or "").strip()
    if value in ("", "0"):
        return False
    flags = cpu_flags() if flags is None else flags
    missing = [f for f in EMULATION_FLAGS if f not in flags]
    lacks = (f"software AMX tiles need avx512f and avx512_bf16; the CPU lacks "
             f"{' and '.join(missing)}") if missing else None
    msg = refusal("MHA_AMX_EMULATE", value, {"1": lacks, "0": None}, "no software tiles")
    if msg is not None:
        raise ValueError(msg)
    return True
