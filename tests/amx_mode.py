"""How the tests reach the AMX tile kernels on the CPU at hand, from its flags (never its
vendor): natively where it has AMX-BF16 and the OS grants the tile state, on the software model
of the tile unit (``MHA_AMX_EMULATE=1``, ``csrc/amx/amx_emulate.h``) where it has AVX512_BF16
without AMX, not at all elsewhere — nor on an AMX CPU whose OS refuses the tile state (a build
there compiles the native tiles, never the software ones: the kernels fall back, and the tests
that need the tiles skip with that reason). Shared by tests/test_kernel_paths.py,
test_amx_paths.py and test_flash_bwd_amx.py.
"""

from __future__ import annotations

import os

from mha.ops.forcing import EMULATION_FLAGS as _EMULATION
from mha.ops.forcing import cpu_flags

AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})
EMULATION_FLAGS = frozenset(_EMULATION)  # what the software tiles need

__all__ = ["AMX_FLAGS", "EMULATION_FLAGS", "cpu_flags", "current", "mode", "tile_state_refused"]


def tile_state_refused() -> str | None:
    """Why Linux refuses this process the AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``, as the kernels ask it: ``csrc/amx/amx_tiles.h``), or None when it
    grants it. ``MHA_TEST_AMX_REFUSED=1`` answers as refused (the kernels' test seam). Only
    meaningful on a CPU with AMX."""
    if os.environ.get("MHA_TEST_AMX_REFUSED") == "1":
        return "the OS refuses the AMX tile state (MHA_TEST_AMX_REFUSED=1)"
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18  # x86-64 Linux
        if libc.syscall(sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata) == 0:
            return None
        why = os.strerror(ctypes.get_errno())
    except (OSError, AttributeError) as e:
        why = str(e)
    return f"the OS refuses the AMX tile state: arch_prctl(ARCH_REQ_XCOMP_PERM) failed ({why})"


def mode(flags: set[str], refused: str | None = None) -> tuple[dict | None, str]:
    """The variables of a run of the AMX kernels on a CPU with these flags (None: they cannot
    run there) and its name (``amx``, ``amx-emulated``) or why not. ``refused``: why the OS
    refuses the tile state (:func:`tile_state_refused`), None where it grants it."""
    env = {"MHA_FLASH_BF16": "amx", "MHA_DECODE_BF16": "amx"}
    if AMX_FLAGS <= flags:
        if refused is not None:
            return None, (f"the CPU has AMX but {refused}: the native AMX tiles cannot run in "
                          "this process (the kernels fall back to the next one)")
        return env, "amx"
    if refused is not None and EMULATION_FLAGS <= flags:  # only the seam refuses software tiles
        return None, f"{refused}: the AMX tiles do not run in this process"
    if EMULATION_FLAGS <= flags:
        return {**env, "MHA_AMX_EMULATE": "1"}, "amx-emulated"
    missing = " / ".join(sorted(EMULATION_FLAGS - flags))
    return None, f"no {missing} on this CPU: neither AMX nor its software tiles can run here"


def current() -> tuple[dict | None, str]:
    """:func:`mode` of this CPU and this process's OS answer (asked only on an AMX CPU)."""
    flags = cpu_flags()
    seam = os.environ.get("MHA_TEST_AMX_REFUSED") == "1"
    return mode(flags, tile_state_refused() if AMX_FLAGS <= flags or seam else None)
