"""Which tiles run the flash kernels' bfloat16 products on this CPU: ``avx512bf16`` (the
products on ``vdpbf16ps``) or ``avx512f`` (bf16 widened to fp32 when K/V are packed, the fp32
tiles), decided by a measurement made once per CPU model and cached beside the built kernels.

Shape legend: B batch, h heads, T length (Tq = Tk), d head dim.

No rule names a vendor: which kernel is faster depends on the CPU's ``vdpbf16ps`` rate against
its fp32 FMA rate (on ``epyc-zen5-avx512``, AMD Zen 5, twice the FLOPs: the peaks ``mha bench``
measures, docs/kernel.md), and other CPUs differ. So the first load of the flash kernel on a
machine times both kernels and keeps the faster.
Nothing is measured where there is nothing to choose (:func:`mha.ops.flash.bf16_choice` says
why): AMX tiles run first where the build has them and the OS grants the tile state; a build
without the ``vdpbf16ps`` kernel (a CPU without AVX512_BF16) widens to fp32; and
``MHA_FLASH_BF16`` forces a kernel.

The measurement (:func:`measure`): the forward's test op
(``torch.ops.mha._flash_attention_fwd_kernel``, which runs a named kernel) on random bf16
q, k, v of ``SHAPE`` (dense, the tiles' steady state: several 64-key blocks per row, and
packing K/V is part of the time), the two kernels called alternately after a warm-up, the
fastest of ``linear_choice.ROUNDS`` batches of about ``BATCH_S`` each
(:func:`mha.ops.linear_choice._fastest`). On one thread and its CPU clock
(``time.thread_time``): what differs between the kernels is the core's arithmetic, and a
machine shared with other work stretches wall-clock times of a parallel call by its slowest
thread. On ``epyc-zen5-avx512`` at load 2.9, ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE
python benchmarks/probes/bf16_choice.py --cases 1,8,512,64,dense --rounds 7`` with
``--threads 2`` (wall clock) timed both kernels equal (12.0 ms, 1.00x, twice), where
``--threads 1`` (that thread's CPU clock) gives 1.88x (1.50 / 2.82 ms). The process's torch
thread count is 1 while it runs (~0.1 s, once per machine and kernel build; later processes
read the file) and restored after (:func:`mha.threads.num_threads`).
``avx512bf16`` is chosen only when at least ``MARGIN`` times faster: within the noise the
widened kernel keeps the call (its P V products take P in fp32, not rounded to bf16). The
fused backward follows the choice (``vdpbf16ps`` products for ``avx512bf16``, fp32 for
``avx512f``); its cost ordering was checked against the forward's
(``benchmarks/probes/bf16_choice.py``: both kernels and both backward arithmetics side by side).

The file, ``<build cache>/mha_flash-choice.json``, has the format, the locking and the atomic
replacement of the projections' choice file (:mod:`mha.ops.linear_choice`, whose machinery this
module uses: the machine key, the conditions, the timer, :func:`~mha.ops.linear_choice.
stored_or_measured`)::

    {"format": 1,
     "machines": {"<cpu> | torch <version> | <flash build key>": {
         "bf16 B1 h8 T512 d64": {"choice": "avx512bf16", "avx512bf16_s": 1.1e-3,
                                 "avx512f_s": 1.8e-3, "shape": [1, 8, 512, 64],
                                 "load": 1.2, "cpus": 2, "speedups": [1.55, 1.66]}}}}

``speedups`` is the range of ``avx512f_s / avx512bf16_s`` over the rounds. The machine key holds
the CPU's identity, torch's version and the flash extension's build key (its sources and
flags), so a changed kernel is measured again. The choice is handed to the extensions by
:mod:`mha.ops.flash` (their setter ops) when they are loaded, before their first bf16 call,
and is fixed for the process from that call on. ``mha build`` prints it; ``mha build
--remeasure`` measures it again.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import torch

from mha.ops import build, linear_choice
from mha.threads import num_threads

FILE = "mha_flash-choice.json"
SHAPE = (1, 8, 512, 64)  # (B, h, T, d) timed: ~2 ms a call on one Zen 5 core
NAME = "bf16 B{} h{} T{} d{}".format(*SHAPE)
BATCH_S = 5e-3  # CPU seconds of one batch of calls
MARGIN = 1.05  # avx512bf16 must be this much faster to be chosen
KERNELS = ("avx512bf16", "avx512f")

_lock = threading.Lock()
_memo: dict[str, Measured] = {}  # machine key -> the choice


@dataclass(frozen=True)
class Measured:
    """The bf16 kernel chosen and the times it rests on (seconds per forward call)."""

    choice: str  # "avx512bf16" | "avx512f"
    bf16_s: float  # avx512bf16
    f32_s: float  # avx512f
    shape: tuple[int, int, int, int]  # the (B, h, T, d) timed
    cpu: str
    conditions: linear_choice.Conditions | None = None

    @classmethod
    def of(cls, bf16_s: float, f32_s: float, shape, cpu: str,
           conditions: linear_choice.Conditions | None = None) -> Measured:
        choice = "avx512bf16" if bf16_s * MARGIN <= f32_s else "avx512f"
        return cls(choice, bf16_s, f32_s, tuple(shape), cpu, conditions)

    def describe(self) -> str:
        """One sentence: which kernel bf16 runs, the two rates and how they were measured."""
        B, h, T, d = self.shape
        rates = (f"avx512bf16 {self.bf16_s * 1e3:.3g} ms, avx512f {self.f32_s * 1e3:.3g} ms a "
                 f"forward of (B={B}, h={h}, T={T}, d={d}) on {self.cpu}")
        if self.conditions is not None:
            rates += f", {self.conditions.describe('avx512bf16')}"
        ratio = self.f32_s / self.bf16_s
        if self.choice == "avx512bf16":
            return f"avx512bf16 (vdpbf16ps): measured {ratio:.2f}x faster than avx512f ({rates})"
        if ratio >= 1:
            return (f"avx512f (bf16 widened to fp32): avx512bf16 measured only {ratio:.2f}x "
                    f"faster, less than the {MARGIN}x required ({rates})")
        return (f"avx512f (bf16 widened to fp32): measured {1 / ratio:.2f}x faster than "
                f"avx512bf16 ({rates})")

    def record(self) -> dict:
        rec = {"choice": self.choice, "avx512bf16_s": self.bf16_s, "avx512f_s": self.f32_s,
               "shape": list(self.shape)}
        if self.conditions is not None:
            rec.update(self.conditions.record())
        return rec


def measure(shape: tuple[int, int, int, int]) -> tuple:
    """Seconds per forward call of ``(avx512bf16, avx512f)`` on bf16 ``(B, h, T, d)`` q, k, v,
    alternating (:func:`mha.ops.linear_choice._fastest`), then the range of avx512bf16's
    per-round speedup. The flash extension must be loaded with both kernels. Tests replace
    this function to inject a measurement (a pair of times is enough)."""
    B, h, T, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, T, d, generator=g).bfloat16() for _ in range(3))  # (B, h, T, d)
    op = torch.ops.mha._flash_attention_fwd_kernel
    with num_threads(1):  # one core's rate, on this thread's CPU clock (see the docstring)
        return linear_choice._fastest(
            tuple((lambda kn=kn: op(q, k, v, None, None, False, d ** -0.5, kn))
                  for kn in KERNELS), clock=time.thread_time, batch_s=BATCH_S)


def path():
    """The cache file (raises :class:`mha.ops.build.BuildError` without a usable cache dir)."""
    return build.cache_root() / FILE


def choose(kernel: str) -> Measured:
    """The measured choice on this machine (``kernel``: the flash extension's build key): from
    this process's memory, else the cache file, else measured now (and stored)."""
    machine = linear_choice.machine_key(kernel)
    with _lock:  # one thread of this process measures; the others wait for its answer
        found = _memo.get(machine)
        if found is None:
            try:
                file = path()
            except build.BuildError:  # no cache directory (warned by build): kept in memory
                found = _measured()
            else:
                found = linear_choice.stored_or_measured(
                    file, machine, NAME, lambda data: _entry(data, machine), _measured)
            _memo[machine] = found
    return found


def forget() -> None:
    """Drop this process's remembered choice (tests; the file stays)."""
    _memo.clear()


def remeasure(kernel: str) -> tuple[Measured | None, Measured]:
    """Measure again on this machine and replace the record, in the file and in this process's
    memory (the extensions keep the kernel they were handed: a new process runs the new
    choice): ``(before, after)``, ``before`` None when there was no sane record. Raises
    :class:`mha.ops.build.BuildError` without a usable cache directory."""
    machine, file = linear_choice.machine_key(kernel), path()
    with _lock, build._exclusive(file.with_suffix(".lock")):
        data = linear_choice._read(file)
        before = _entry(data, machine)
        after = _measured()
        data["machines"].setdefault(machine, {})[NAME] = after.record()
        linear_choice._write(file, data)
        _memo[machine] = after
    return before, after


def _measured() -> Measured:
    timed = measure(SHAPE)  # (avx512bf16_s, avx512f_s[, (lowest, highest) speedup])
    conditions = linear_choice.Conditions.now(tuple(timed[2]) if len(timed) > 2 else None)
    return Measured.of(timed[0], timed[1], SHAPE, linear_choice.cpu_model(), conditions)


def _entry(data: dict, machine: str) -> Measured | None:
    """The stored choice on ``machine``, if it is whole and sane."""
    e = data["machines"].get(machine, {}).get(NAME)
    try:
        bf16_s, f32_s = float(e["avx512bf16_s"]), float(e["avx512f_s"])
        shape = linear_choice.record_shape(e["shape"], 4)
    except (TypeError, KeyError, ValueError):
        return None
    if not (0 < bf16_s < math.inf and 0 < f32_s < math.inf) or shape is None \
            or e.get("choice") != Measured.of(bf16_s, f32_s, shape, "").choice:
        return None
    return Measured.of(bf16_s, f32_s, shape, linear_choice.cpu_model(),
                       linear_choice.Conditions.from_record(e))
