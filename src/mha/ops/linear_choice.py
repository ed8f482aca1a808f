"""Which GEMM runs the module's projections on this CPU: mha.linear's native tiles or torch's
(``F.linear``: MKL / oneDNN), decided by a measurement made once per CPU model and cached
beside the built kernels.

Shape legend: M rows of x, N output features, K input features (``x (M, K) W^T``, W ``(N, K)``).

Neither GEMM wins everywhere: the native tiles beat MKL's AVX2 path on the AVX-512 EPYC, MKL's
AVX-512 path beats them on the Intel Xeon, and on CPUs without AVX-512 the native op has only
its portable loops. So no rule names a vendor: the first fp32 projection of a shape class on a
machine times both GEMMs on that class and keeps the faster. A shape class (:class:`Bucket`)
is M, N and K each rounded to the nearest power of two; the module's projections fall into a
handful of them (``(B T, 3 d_model, d_model)`` and ``(B T, d_model, d_model)``).

The measurement (:func:`measure`): both GEMMs on random fp32 tensors of the class's shape (M
lowered to keep one call under ``BUDGET`` multiply-adds, never below ``MIN_ROWS``), called
alternately after a warm-up, the fastest of ``ROUNDS`` batches of each (a batch lasts about a
millisecond); the native tiles are chosen only when at least ``MARGIN`` times faster — within
the noise torch's GEMM keeps the call.

The file, ``<build cache>/mha_linear-choice.json`` (:func:`mha.ops.build.cache_root`)::

    {"format": 1,
     "machines": {"<cpu> | torch <version> | <kernel build key>": {
         "M512 N2048 K512": {"choice": "torch", "native_s": 2.1e-3, "torch_s": 1.2e-3,
                             "shape": [512, 2048, 512], "load": 1.85, "cpus": 2,
                             "speedups": [0.55, 0.61]}}}}

Each record says under what conditions it was taken: the 1-minute load average and the CPU
count when it was measured (``load``, ``cpus``) and the range of the native side's speedup
(``torch_s / native_s``) over the ``ROUNDS`` batch pairs (``speedups``, lowest and highest).
:meth:`Measured.describe` (so ``mha.explain`` and :func:`mha.ops.linear.why_not_native`) shows
them, and says when the two sides are within the measurement's own noise (the per-round
speedups fall on both sides of 1). Records without them (older files) stay valid.
``mha build --remeasure`` (:func:`remeasure`) measures every class recorded for this machine
again, e.g. after a measurement taken on a loaded machine.

The machine key holds the CPU's identity (model name, vendor, family / model / stepping and its
instruction-set flags: VMs show several kinds of CPU as the same "AMD EPYC"), torch's version
(its GEMM) and the native extension's build key (its sources and flags), so a change of any of
them measures again. JSON only, never unpickled. It is read without a lock; a class missing
from it is measured under an exclusive ``flock`` of ``mha_linear-choice.lock`` and the file
re-read under that lock first, so two processes that start together measure once and neither
loses the other's classes. Writes go to a private temporary file moved in with
``os.replace``: a reader sees the old file or the new one, never a partial one. A file that
is not valid JSON of this format (truncated, hand-edited) is treated as absent: measured
again and replaced. Without a usable cache directory the choice is measured and kept in memory
for this process.

bfloat16 projections have a choice of their own: torch's bf16 GEMM, or mha's native side —
the native op's bf16 tiles (``vdpbf16ps``, fp32 sums rounded once) where the build has them
(AVX512_BF16), else upcasting x, W and b to fp32, the fp32 projection (itself measured as
above) and one rounding back to bf16 (on CPUs without bf16 instructions torch's bf16 GEMM was
measured 3.3x slower than that). Their classes are stored as ``"bf16 tiles M.. N.. K.."``
(``native_s``: the bf16 tiles' time, :func:`measure_bf16_tiles`) and ``"bf16 M.. N.. K.."``
(``native_s``: the upcast path's time, :func:`measure_bf16`).

``MHA_LINEAR`` (read once) forces a side for every projection: ``native`` (the native tiles;
bf16: the bf16 tiles, or upcast to the fp32 tiles where the build lacks them) or ``torch``
(torch's GEMM in the input's dtype); unset or ``measure`` is the measured choice.
"""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mha.ops import build, forcing

FORMAT = 1
FILE = "mha_linear-choice.json"
BUDGET = 1 << 30  # multiply-adds of one measured call, at most (M lowered to fit) ...
MIN_ROWS = 512  # ... but never below 512 rows (M = 64 misjudged M = 4096 by 2x: packing W)
ROUNDS = 5  # batches of each GEMM, alternating; the fastest counts
BATCH_S = 1e-3  # about this long per batch
MARGIN = 1.05  # the native tiles must be this much faster to be chosen
SIDES = ("native", "torch")
ENV = "MHA_LINEAR"

_lock = threading.Lock()
# (machine, bucket name) -> the choice; and (M, N, K, kernel, bf16, tiles) of a call -> its
# class's choice, the per-call lookup without the class name's arithmetic and formatting (~4 us
# of the fused module call's ~21 us Python path), dropped when a class is measured again
_memo: dict[tuple, Measured] = {}


@dataclass(frozen=True)
class Bucket:
    """A shape class: M, N and K rounded to the nearest power of two (N, K at least 16)."""

    M: int
    N: int
    K: int

    @classmethod
    def of(cls, M: int, N: int, K: int) -> Bucket:
        return cls(_pow2(M, 1), _pow2(N, 16), _pow2(K, 16))

    @property
    def name(self) -> str:
        return f"M{self.M} N{self.N} K{self.K}"

    @property
    def shape(self) -> tuple[int, int, int]:
        """The ``(M, N, K)`` measured for the class: M lowered to fit ``BUDGET``."""
        rows = max(min(self.M, MIN_ROWS), min(self.M, BUDGET // (self.N * self.K)))
        return rows, self.N, self.K


def _pow2(n: int, low: int) -> int:
    return max(low, 1 << max(0, round(math.log2(max(n, 1)))))


@dataclass(frozen=True)
class Measured:
    """The choice for one shape class and the times it rests on (seconds per call)."""

    choice: str  # "native" | "torch"
    native_s: float
    torch_s: float
    shape: tuple[int, int, int]  # the (M, N, K) timed
    cpu: str
    bf16: bool = False  # a bfloat16 class: "native" is the fp32 GEMM on upcast inputs ...
    tiles: bool = False  # ... or, with tiles, the native op's bf16 tiles
    conditions: Conditions | None = None  # how it was taken (None: a record without them)

    @classmethod
    def of(cls, native_s: float, torch_s: float, shape, cpu: str, bf16: bool = False,
           tiles: bool = False, conditions: Conditions | None = None) -> Measured:
        choice = "native" if native_s * MARGIN <= torch_s else "torch"
        return cls(choice, native_s, torch_s, tuple(shape), cpu, bf16, bf16 and tiles,
                   conditions)

    def describe(self) -> str:
        """One sentence: what runs, the measurement behind it and its conditions."""
        M, N, K = self.shape
        where = f"for (M={M}, N={N}, K={K}) on {self.cpu}"
        if self.conditions is not None:
            where += f" ({self.conditions.describe()})"
        ours, theirs = (("the native bf16 tiles", "torch's bf16 GEMM") if self.tiles
                        else ("an fp32 GEMM on upcast inputs", "torch's bf16 GEMM") if self.bf16
                        else ("the native tiles", "torch's GEMM"))
        if self.choice == "native":
            return f"{ours}: measured {self.torch_s / self.native_s:.2f}x faster than {theirs} {where}"
        ratio = self.native_s / self.torch_s
        if ratio >= 1:
            return f"{theirs}: measured {ratio:.2f}x faster than {ours} {where}"
        return (f"{theirs}: {ours} measured only {1 / ratio:.2f}x faster "
                f"(less than the {MARGIN}x required) {where}")

    def record(self) -> dict:
        rec = {"choice": self.choice, "native_s": self.native_s, "torch_s": self.torch_s,
               "shape": list(self.shape)}
        if self.conditions is not None:
            rec.update(self.conditions.record())
        return rec


@dataclass(frozen=True)
class Conditions:
    """Under what a measurement was taken: the 1-minute load average and CPU count then, and
    the lowest and highest speedup of the native side (``torch_s / native_s``) over the
    rounds (None when the timer did not report them)."""

    load: float
    cpus: int
    speedups: tuple[float, float] | None = None

    @classmethod
    def now(cls, speedups: tuple[float, float] | None = None) -> Conditions:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not available on this platform
            load = math.nan
        return cls(round(load, 2), os.cpu_count() or 1, speedups)

    @property
    def within_noise(self) -> bool:
        """Whether the rounds disagree on which side is faster (speedups on both sides of 1):
        the two sides are within this measurement's own noise."""
        return self.speedups is not None and self.speedups[0] < 1 < self.speedups[1]

    def describe(self, side: str = "native") -> str:
        """In words; ``side``: whose speedup the rounds' range is (the native side's here)."""
        said = f"measured at load {self.load:.2f} on {self.cpus} CPUs"
        if self.speedups is not None:
            lo, hi = self.speedups
            said += f", {side} speedup {lo:.2f}-{hi:.2f}x over {ROUNDS} rounds"
        if self.within_noise:
            said += ("; the two sides are within this measurement's noise "
                     "(`mha build --remeasure` on an idle machine measures again)")
        return said

    def record(self) -> dict:
        rec = {"load": self.load, "cpus": self.cpus}
        if self.speedups is not None:
            rec["speedups"] = [round(x, 4) for x in self.speedups]
        return rec

    @classmethod
    def from_record(cls, e: dict) -> Conditions | None:
        """The conditions stored in a record, or None when absent or not sane."""
        try:
            load, cpus = float(e["load"]), int(e["cpus"])
            sp = e.get("speedups")
            speedups = None if sp is None else (float(sp[0]), float(sp[1]))
        except (TypeError, KeyError, ValueError, IndexError, OverflowError):  # int(inf)
            return None
        if speedups is not None and not (0 < speedups[0] <= speedups[1] < math.inf):
            speedups = None
        return cls(load, max(cpus, 1), speedups)


# ----------------------------------------------------------------------------- the machine
@functools.cache
def cpu_fields() -> dict:
    """The first processor's identity in ``/proc/cpuinfo`` (model name, vendor, family, model,
    stepping, flags); the platform's processor string where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return {"model name": platform.processor() or platform.machine()}
    fields: dict = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor is enough
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_model() -> str:
    """The model name as the CPU reports it, e.g. ``AMD EPYC``."""
    return cpu_fields().get("model name") or "an unknown CPU"


@functools.cache
def machine_key(kernel: str) -> str:
    """``<cpu> | torch <version> | <kernel>``: what the measured times depend on."""
    f = cpu_fields()
    isa = sorted(set(f.get("flags", "").split()) & {"avx2", "fma", "avx512f", "avx512_bf16",
                                                    "avx512_fp16", "amx_bf16", "amx_tile"})
    cpu = (f"{cpu_model()} ({f.get('vendor_id', '?')} family {f.get('cpu family', '?')} "
           f"model {f.get('model', '?')} stepping {f.get('stepping', '?')}; "
           f"{' '.join(isa) or 'no AVX2'})")
    return f"{cpu} | torch {torch.__version__} | {kernel}"


@functools.cache
def forced() -> str | None:
    """``MHA_LINEAR``: ``"native"`` or ``"torch"`` to force a side, None to measure."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "measure"):
        return None
    if value not in SIDES:  # the words of mha.ops.forcing (whether native can run: linear.py)
        raise ValueError(forcing.refusal(ENV, os.environ[ENV].strip(),
                                         dict.fromkeys((*SIDES, "measure")),
                                         "the measured side"))
    return value


# ----------------------------------------------------------------------------- measuring
def measure(shape: tuple[int, int, int]) -> tuple:
    """Seconds per call of ``(native tiles, torch's F.linear)`` on fp32 ``x (M, K)``, ``W (N, K)``
    and a bias, alternating, the fastest of ``ROUNDS`` batches each, then the range of the
    native side's per-round speedup. The native op must be loaded. Tests replace this function
    to inject a measurement (a pair of times is enough)."""
    M, N, K = shape
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g) for s in ((M, K), (N, K), (N,)))
    return _fastest((lambda: torch.ops.mha.linear(x, w, b), lambda: F.linear(x, w, b)))


def _fastest(fns, clock=time.perf_counter,
             batch_s: float = BATCH_S) -> tuple[float, float, tuple[float, float]]:
    """The two functions called alternately: the fastest of ``ROUNDS`` batches of each (a
    batch lasts about ``batch_s`` of ``clock``), and the lowest and highest per-round speedup
    of the first (``second / first``: the noise)."""
    with torch.no_grad():
        reps = []
        for fn in fns:
            fn()  # warm-up: first-touch pages, thread pool
            t0 = clock()
            fn()
            reps.append(max(1, min(1000, int(batch_s / max(clock() - t0, 1e-7)))))
        best, speedups = [math.inf, math.inf], []
        for _ in range(ROUNDS):
            took = []
            for i, fn in enumerate(fns):
                t0 = clock()
                for _ in range(reps[i]):
                    fn()
                took.append((clock() - t0) / reps[i])
                best[i] = min(best[i], took[i])
            speedups.append(took[1] / max(took[0], 1e-12))
    return best[0], best[1], (min(speedups), max(speedups))


def measure_bf16(shape: tuple[int, int, int]) -> tuple:
    """Seconds per call of ``(fp32 GEMM on upcast inputs, torch's bf16 F.linear)`` on bfloat16
    ``x (M, K)``, ``W (N, K)`` and a bias, as :func:`measure` times its pair."""
    M, N, K = shape
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g).bfloat16() for s in ((M, K), (N, K), (N,)))
    return _fastest((lambda: F.linear(x.float(), w.float(), b.float()).bfloat16(),
                     lambda: F.linear(x, w, b)))


def measure_bf16_tiles(shape: tuple[int, int, int]) -> tuple:
    """Seconds per call of ``(the native op's bf16 tiles, torch's bf16 F.linear)`` on bfloat16
    ``x (M, K)``, ``W (N, K)`` and a bias, as :func:`measure` times its pair. The native op must
    be loaded with its bf16 tiles."""
    M, N, K = shape
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g).bfloat16() for s in ((M, K), (N, K), (N,)))
    return _fastest((lambda: torch.ops.mha.linear_bf16(x, w, b), lambda: F.linear(x, w, b)))


# ----------------------------------------------------------------------------- the choice
def choose(M: int, N: int, K: int, kernel: str, *, bf16: bool = False,
           tiles: bool = False) -> Measured:
    """The measured choice for the class of ``(M, N, K)``: from this process's memory, else the
    cache file, else measured now (and stored). ``kernel`` names the native build measured.
    ``bf16``: the class of bfloat16 projections, torch's bf16 GEMM against the native op's bf16
    tiles (``tiles``, stored as ``"bf16 tiles M.. N.. K.."``) or against the fp32 GEMM on upcast
    inputs (stored as ``"bf16 M.. N.. K.."``)."""
    call = (M, N, K, kernel, bf16, tiles)
    found = _memo.get(call)
    if found is not None:
        return found
    machine, bucket = machine_key(kernel), Bucket.of(M, N, K)
    tiles = bf16 and tiles
    name = (f"bf16 tiles {bucket.name}" if tiles else f"bf16 {bucket.name}" if bf16
            else bucket.name)
    with _lock:  # one thread of this process measures; the others wait for its answer
        found = _memo.get((machine, name))
        if found is None:
            found = _from_file_or_measure(machine, bucket, name, bf16, tiles)
            _memo[machine, name] = found
        _memo[call] = found
    return found


def forget() -> None:
    """Drop this process's remembered choices (tests; the file stays)."""
    _memo.clear()


def path() -> Path:
    """The cache file (raises :class:`mha.ops.build.BuildError` without a usable cache dir)."""
    return build.cache_root() / FILE


def _from_file_or_measure(machine: str, bucket: Bucket, name: str, bf16: bool,
                          tiles: bool) -> Measured:
    try:
        file = path()
    except build.BuildError:  # no cache directory (already warned by build): keep it in memory
        return _measured(bucket, bf16, tiles)
    return stored_or_measured(file, machine, name,
                              lambda data: _entry(data, machine, name, bf16, tiles),
                              lambda: _measured(bucket, bf16, tiles))


def stored_or_measured(file: Path, machine: str, name: str, parse, measure):
    """The record ``name`` of ``machine`` in the choice file ``file`` (this module's format),
    or, when it is missing or not sane, ``measure()`` stored there: under an exclusive
    ``flock`` of ``file`` with the suffix ``.lock``, the file re-read under it first (another
    process may have measured it meanwhile), written atomically. ``parse(data)`` turns the
    file's contents into the choice (None: absent or not sane); ``measure()`` returns one with
    a ``record()``. A lock or a file that cannot be written: measured, not cached. Shared by
    every measured choice (the projections' here, the flash bf16 kernel's in
    :mod:`mha.ops.flash_choice`)."""
    found = parse(_read(file))
    if found is not None:
        return found
    try:
        with build._exclusive(file.with_suffix(".lock")):
            data = _read(file)  # again, under the lock: another process may have measured it
            found = parse(data)
            if found is None:
                found = measure()
                data.setdefault("machines", {}).setdefault(machine, {})[name] = found.record()
                _write(file, data)
    except (build.BuildError, OSError):  # a lock or a file that cannot be written: not cached
        found = found or measure()
    return found


def _measured(bucket: Bucket, bf16: bool, tiles: bool) -> Measured:
    timer = measure_bf16_tiles if tiles else measure_bf16 if bf16 else measure
    timed = timer(bucket.shape)  # (native_s, torch_s[, (lowest, highest) speedup])
    native_s, torch_s = timed[0], timed[1]
    conditions = Conditions.now(tuple(timed[2]) if len(timed) > 2 else None)
    return Measured.of(native_s, torch_s, bucket.shape, cpu_model(), bf16, tiles, conditions)


def _read(file: Path) -> dict:
    """The file's contents, or a fresh ``{"format": 1, "machines": {}}`` when it is missing,
    not JSON, or not of this format."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        data = None
    if not (isinstance(data, dict) and data.get("format") == FORMAT
            and isinstance(data.get("machines"), dict)
            and all(isinstance(v, dict) for v in data["machines"].values())):
        return {"format": FORMAT, "machines": {}}
    return data


def record_shape(value, n: int) -> tuple[int, ...] | None:
    """A record's ``shape``: a list of ``n`` positive JSON integers, else None (not sane: a
    string "123" would read as (1, 2, 3), a float 8.7 as 8)."""
    if not isinstance(value, list) or len(value) != n:
        return None
    if not all(type(x) is int and x > 0 for x in value):
        return None
    return tuple(value)


def _entry(data: dict, machine: str, name: str, bf16: bool, tiles: bool) -> Measured | None:
    """The stored choice of the class ``name`` on ``machine``, if it is whole and sane."""
    e = data["machines"].get(machine, {}).get(name)
    try:
        native_s, torch_s = float(e["native_s"]), float(e["torch_s"])
        shape = record_shape(e["shape"], 3)
    except (TypeError, KeyError, ValueError):
        return None
    if not (0 < native_s < math.inf and 0 < torch_s < math.inf) or shape is None \
            or e.get("choice") != Measured.of(native_s, torch_s, shape, "").choice:
        return None
    return Measured.of(native_s, torch_s, shape, cpu_model(), bf16, tiles,
                       Conditions.from_record(e))


def remeasure(kernel: str) -> list[tuple[str, Measured | None, Measured]]:
    """Measure again every class recorded for this machine (``kernel``: the native build's key,
    as :func:`choose` takes it) and replace the records, in the file and in this process's
    memory: ``(class name, before, after)`` each, ``before`` None when the record was not sane.
    Under the file's lock, like a first measurement. Raises
    :class:`mha.ops.build.BuildError` without a usable cache directory."""
    machine, file = machine_key(kernel), path()
    done = []
    with _lock, build._exclusive(file.with_suffix(".lock")):
        data = _read(file)
        entries = data["machines"].get(machine, {})
        for name in sorted(entries):
            parsed = _parse(name)
            if parsed is None:
                continue  # not a class name of this format: left as it is
            bucket, bf16, tiles = parsed
            before = _entry(data, machine, name, bf16, tiles)
            after = _measured(bucket, bf16, tiles)
            entries[name] = after.record()
            _memo[machine, name] = after
            for call in [key for key in _memo if len(key) != 2]:  # the calls' lookups
                del _memo[call]
            done.append((name, before, after))
        if done:
            _write(file, data)
    return done


def _parse(name: str) -> tuple[Bucket, bool, bool] | None:
    """``(bucket, bf16, tiles)`` of a stored class name (``"bf16 tiles M.. N.. K.."``, ...)."""
    words = name.split()
    bf16, tiles = words[:1] == ["bf16"], words[:2] == ["bf16", "tiles"]
    dims = words[1 + tiles:] if bf16 else words
    try:
        M, N, K = (int(w[1:]) for w, letter in zip(dims, "MNK", strict=True)
                   if w[:1] == letter)
    except ValueError:
        return None
    return Bucket(M, N, K), bf16, tiles


def _write(file: Path, data: dict) -> None:
    """Replace ``file`` atomically: a private temporary file in the same directory, then
    ``os.replace``."""
    fd, part = tempfile.mkstemp(prefix=f".{file.name}.", suffix=".part", dir=file.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(part, file)
    except BaseException:
        Path(part).unlink(missing_ok=True)
        raise
