"""How the tests reach the AMX tile kernels on the CPU at hand, from its flags (never its
vendor): natively where it has AMX-BF16, on the software model of the tile unit
(``MHA_AMX_EMULATE=1``, ``csrc/amx/amx_emulate.h``) where it has AVX512_BF16 without AMX, not at
all elsewhere. Shared by tests/test_kernel_paths.py, test_amx_paths.py and test_flash_bwd_amx.py.
"""

from __future__ import annotations

from pathlib import Path

AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})
EMULATION_FLAGS = frozenset({"avx512f", "avx512_bf16"})  # what the software tiles need


def cpu_flags() -> set[str]:
    """The first processor's flags in /proc/cpuinfo (empty where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def mode(flags: set[str]) -> tuple[dict | None, str]:
    """The variables of a run of the AMX kernels on a CPU with these flags (None: they cannot
    run there) and its name (``amx``, ``amx-emulated``) or why not."""
    env = {"MHA_FLASH_BF16": "amx", "MHA_DECODE_BF16": "amx"}
    if AMX_FLAGS <= flags:
        return env, "amx"
    if EMULATION_FLAGS <= flags:
        return {**env, "MHA_AMX_EMULATE": "1"}, "amx-emulated"
    missing = " / ".join(sorted(EMULATION_FLAGS - flags))
    return None, f"no {missing} on this CPU: neither AMX nor its software tiles can run here"
