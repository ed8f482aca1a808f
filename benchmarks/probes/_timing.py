"""What the scripts in ``benchmarks/probes/`` share: the one timer (round-robin medians in one
process) and the A/B probes' ``--variant`` option and builds (flash_ab.py, fused_ab.py,
decode_ab.py).

Each round calls every function once (or a batch of calls sized to ``min_time``), so a noisy
neighbour on a shared machine slows all of them alike; the result is the median seconds per
call of each. (``mha bench`` has its own, fuller harness in ``mha.bench.core``.)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, *, min_time: float = 0.0,
                warmup: int = 1, clock: Callable[[], float] = time.perf_counter,
                inner: int | None = None,
                stat: Callable[[list[float]], float] = statistics.median) -> dict[str, float]:
    """Median (or ``stat``, e.g. ``min``) seconds per call of each function in ``fns``, timed
    round-robin with ``clock`` (wall time; ``time.thread_time`` counts only the calling
    thread's CPU time, which keeps a busy machine's descheduling out of one-thread timings).
    A round calls each function ``inner`` times, or as often as fills ``min_time``."""
    calls = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()  # warm-up (and native builds)
        t0 = clock()
        fn()
        calls[name] = inner or max(1, int(min_time / max(clock() - t0, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = clock()
            for _ in range(calls[name]):
                fn()
            samples[name].append((clock() - t0) / calls[name])
    return {name: stat(v) for name, v in samples.items()}


def add_variant_argument(ap: argparse.ArgumentParser) -> None:
    """The A/B probes' ``--variant name=CSRC_DIR[:-DFLAG...]`` option (repeatable, required)."""
    ap.add_argument("--variant", action="append", required=True,
                    help="name=CSRC_DIR[:-DFLAG[:-DFLAG...]] (the first is the reference)")


def variants(specs: list[str]) -> list[tuple[str, Path, list[str]]]:
    """``(name, source tree, -D flags)`` of each ``--variant`` spec, in order."""
    out = []
    for spec in specs:
        name, _, rest = spec.partition("=")
        csrc, *defines = rest.split(":")
        out.append((name, Path(csrc).resolve(), defines))
    return out


def build_variant(name: str, csrc: Path, defines: list[str], source: str, folder: str) -> None:
    """Compile ``source`` (e.g. flash/flash_attn.cpp) of the tree ``csrc`` with its ops under
    ``mha_ab_<name>`` and ``defines``, and load it; kept in ``<build cache>/<folder>``, keyed by
    the flags, the source and every header of the tree."""
    import hashlib

    import torch
    from torch.utils import cpp_extension

    from mha.ops import build

    flags = [*build.FLAGS, f"-Dmha=mha_ab_{name}", *defines]
    h = hashlib.sha256(" ".join(flags).encode())
    for f in sorted(csrc.rglob("*.h")) + [csrc / source]:
        h.update(str(f.relative_to(csrc)).encode())
        h.update(f.read_bytes())
    tag = f"mha_ab_{name}_{h.hexdigest()[:12]}"
    out = build.cache_root() / folder / tag
    lib = out / f"{tag}.so"
    if lib.exists():
        torch.ops.load_library(str(lib))
        return
    out.mkdir(parents=True, exist_ok=True)
    print(f"building {name} ({csrc}, {' '.join(defines) or 'no extra flags'}) ...", flush=True)
    cpp_extension.load(name=tag, sources=[str(csrc / source)], extra_cflags=flags,
                       extra_ldflags=list(build.LDFLAGS), extra_include_paths=[str(csrc)],
                       build_directory=str(out), is_python_module=False)
