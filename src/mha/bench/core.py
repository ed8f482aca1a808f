"""The benchmark harness: cases, timing, peak memory, and the row record.

Shape legend (for the attention cases): B batch, h query heads, h_kv key/value heads,
Tq/Tk query/key lengths, d head dim, d_model model width.

Adding a suite (no edit to this package needed)
-----------------------------------------------
A suite is a module ``mha.bench.<name>`` listed in :data:`SUITES` (``mha bench --suite name``
also accepts any importable ``mha.bench.<name>``). It exposes **one** of:

``def cases(ctx: Context) -> list[Case]``
    The harness times every :class:`Case` (warm-up, interleaved repeats, median, peak memory)
    and turns it into rows. Build inputs inside each :class:`Impl`'s ``make`` — it runs only
    when the case passes ``--filter``, so listing cases must be cheap. ``ctx.quick`` asks for a
    tiny grid (the whole quick run should take well under a minute).

``def run(ctx: Context) -> list[Row]``
    The suite measures by itself (e.g. a decode loop) and returns finished rows; it may still
    call ``ctx.measure(case)`` for parts that fit the Case model, and should honour
    ``ctx.selected(case_name)``.

Optionally ``TITLE = "one line"``. A suite that cannot be imported (missing optional dependency,
not written yet) is reported as skipped with the import error as its reason.

An :class:`Impl` is ``Impl(name, make)`` where ``make() -> fn`` sets up inputs/models and returns
a zero-argument callable that performs exactly one call (and waits for its result: JAX must
``block_until_ready``). Compile inside ``make`` (call the compiled function once there), so the
first timed call measures memory and speed rather than the compiler. A string attribute
``fn.note`` on the returned callable is added to the row's note (e.g. the compile time), and
``fn.verify(output) -> str``, when present, is given the output of the first (memory-probe)
call: it raises if the result is wrong (the row becomes an error) and otherwise returns how it
was checked, kept as the row's ``check`` (e.g. the max error against a reference).
Inputs shared by several impls can be memoized by the suite and released by ``Case.teardown``,
which the harness calls once the case is measured. ``make`` may raise :class:`Skip` (``"install mha[onnx]"``,
``"would need 16 GiB"``); the row then shows ``skipped`` with that reason. Any other exception
becomes an ``error`` row carrying its message — never a fake number.

A :class:`Case` says what one call does, so rows can show a rate besides the time: ``flops``
(→ GFLOP/s), ``bytes`` (→ GB/s, e.g. K/V read per decode step), ``items`` with ``item_unit``
(→ tokens/s, sentences/s). ``metric`` picks which one the table, markdown and plot lead with
(``"gflops"``, ``"gbs"``, ``"items"`` or ``"time"``). ``baseline`` names the impl the ratio column
is taken against (ratio = baseline time / impl time, so > 1 means faster than the baseline).
``peak`` names a machine peak (``"fp32"``, ``"bf16"`` in GFLOP/s, ``"mem_read"`` in GB/s; see
:mod:`mha.bench.peaks`) for the "% of peak" column.

Timing (see :func:`measure`): under ``torch.no_grad()``, every impl of a case is set up, then
called once alone to measure its memory, warmed up, and then timed in interleaved rounds
(A, B, C, A, B, C, ...) so that machine noise hits all of them alike. Each sample times enough
back-to-back calls to last ~``ctx.sample_time``; rounds continue until every impl has at least
``ctx.repeat`` samples and ``ctx.min_time`` seconds of timed calls (or ``ctx.max_case_time``
has passed, but never fewer than 3 samples). The row reports the median time per call and the
half inter-quartile range relative to it (``spread``; half the range below 4 samples).

Peak memory (``mem_bytes``): the growth of the process's resident set during one call, over
what it held just before that call (inputs, weights and compiled code excluded). Measured on
Linux by resetting the kernel's high-water mark (``/proc/self/clear_refs`` ← 5) and reading
``VmHWM``, after ``malloc_trim(0)`` returns freed heap memory to the system, so it sees every
allocator in the process (torch, ONNX Runtime, XLA) at page granularity. Memory an allocator
keeps cached from an earlier call is not counted again (ONNX Runtime's arena is disabled for
this reason). ``None`` where the probe is unavailable.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

# Suites `mha bench` lists; each is the module mha.bench.<name>.
SUITES = ("attention", "decode", "hf", "variants", "llm")


class Skip(Exception):  # noqa: N818 — a signal, not an error
    """Raised by ``Impl.make`` (or a suite) when an implementation cannot run here; the message
    is the reason shown to the user (e.g. ``"onnxruntime not installed: pip install mha[onnx]"``)."""


@dataclass
class Impl:
    """One implementation of a case: ``make()`` builds inputs and returns the call to time."""

    name: str
    make: Callable[[], Callable[[], object]]
    note: str = ""


@dataclass
class Case:
    """One measured situation (a shape, dtype, mask...) and its implementations."""

    name: str
    impls: list[Impl]
    flops: float | None = None  # useful floating-point operations per call
    bytes: float | None = None  # bytes that must move per call (e.g. K/V read per step)
    items: float | None = None  # items produced per call (tokens, sentences)
    item_unit: str = ""  # "tokens", "sentences"
    metric: str = "gflops"  # which rate leads: gflops | gbs | items | time
    baseline: str | None = None  # impl name for the ratio column
    peak: str | None = None  # key into ctx.peaks for "% of peak"
    params: dict = field(default_factory=dict)  # shape etc., copied into every row
    note: str = ""
    teardown: Callable[[], None] | None = None  # called after measuring (free shared inputs)


@dataclass
class Row:
    """One (case, implementation) result — the record written to JSON."""

    suite: str
    case: str
    impl: str
    status: str = "ok"  # ok | skipped | error
    reason: str = ""  # why skipped / the error
    seconds: float | None = None  # median time per call
    spread: float | None = None  # half inter-quartile range / median (half range if < 4 samples)
    samples: int = 0
    calls: int = 0  # timed calls in total
    flops: float | None = None
    bytes: float | None = None
    items: float | None = None
    item_unit: str = ""
    metric: str = "gflops"
    mem_bytes: int | None = None
    baseline: str | None = None
    ratio: float | None = None  # baseline seconds / seconds (> 1: faster than the baseline)
    peak: str | None = None
    pct_peak: float | None = None  # percent of ctx.peaks[peak]
    params: dict = field(default_factory=dict)
    note: str = ""
    check: str = ""  # how the output was verified before timing (empty: not checked)
    load: float | None = None  # 1-minute load average when the case was measured (noise hint)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.seconds is not None

    @property
    def gflops(self) -> float | None:
        return self.flops / self.seconds / 1e9 if self.ok and self.flops else None

    @property
    def gbs(self) -> float | None:
        return self.bytes / self.seconds / 1e9 if self.ok and self.bytes else None

    @property
    def items_per_s(self) -> float | None:
        return self.items / self.seconds if self.ok and self.items else None

    def rate(self) -> float | None:
        """The leading metric's value (``time`` → seconds)."""
        return {"gflops": self.gflops, "gbs": self.gbs, "items": self.items_per_s,
                "time": self.seconds if self.ok else None}[self.metric]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(gflops=self.gflops, gbs=self.gbs, items_per_s=self.items_per_s)
        return d


@dataclass
class Context:
    """Settings and shared state handed to every suite."""

    quick: bool = False
    filter: tuple[str, ...] = ()  # substrings of case names (any matches); empty = all
    impl_filter: tuple[str, ...] = ()  # substrings of impl names (any matches); empty = all
    repeat: int = 5  # minimum timed samples per impl
    min_time: float = 0.5  # minimum seconds of timed calls per impl
    sample_time: float = 0.03  # target seconds per sample (calls are batched up to it)
    max_case_time: float = 25.0  # stop adding rounds after this (still >= 3 samples)
    settle: float = 0.05  # pause after each sample: other runtimes' spinning threads wind down
    mem_budget: float = 3 * 2**30  # impls that would allocate more are skipped, with the figure
    measure_memory: bool = True
    peaks: dict = field(default_factory=dict)  # name -> mha.bench.peaks.Peak
    on_row: Callable[[Row], None] | None = None  # progress hook

    def selected(self, case_name: str) -> bool:
        return not self.filter or any(f.lower() in case_name.lower() for f in self.filter)

    def impl_selected(self, impl_name: str) -> bool:
        return not self.impl_filter or any(f.lower() in impl_name.lower()
                                           for f in self.impl_filter)

    def measure(self, case: Case, suite: str = "") -> list[Row]:
        return measure(case, self, suite)


def load_suite(name: str):
    """``(module, None)`` or ``(None, reason)`` when ``mha.bench.<name>`` cannot be used."""
    try:
        mod = importlib.import_module(f"mha.bench.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"mha.bench.{name}":
            return None, f"suite module mha.bench.{name} is not installed in this version"
        return None, f"cannot import mha.bench.{name}: {e}"
    except Exception as e:  # a broken optional suite must not break the others
        return None, f"cannot import mha.bench.{name}: {type(e).__name__}: {e}"
    if not (hasattr(mod, "cases") or hasattr(mod, "run")):
        return None, f"mha.bench.{name} defines neither cases(ctx) nor run(ctx)"
    return mod, None


def check_suite(name: str) -> None:
    """Raise ValueError unless ``name`` is a suite: one of :data:`SUITES`, or a module
    ``mha.bench.<name>`` defining ``cases`` or ``run``. A suite whose optional dependency is
    missing passes (``load_suite`` reports it as skipped); an unknown name does not."""
    if name in SUITES:
        return
    known = f"known suites: {', '.join(SUITES)}"
    if not name.isidentifier():
        raise ValueError(f"unknown suite {name!r}; {known}")
    mod, why = load_suite(name)
    if mod is None and (why.endswith("is not installed in this version")
                        or why.endswith("defines neither cases(ctx) nor run(ctx)")):
        raise ValueError(f"unknown suite {name!r}; {known}")


# ----------------------------------------------------------------------------- memory probe
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def call_with_memory(fn: Callable[[], object], probe: bool = True):
    """Run ``fn`` once: ``(output, seconds, resident-set growth in bytes or None)``."""
    ok = probe and _reset_hwm()
    before = _status_kib("VmRSS") if ok else None
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    hwm = _status_kib("VmHWM") if ok else None
    if before is None or hwm is None:
        return out, dt, None
    return out, dt, max(0, hwm - before) * 1024


def _load1() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


# ----------------------------------------------------------------------------- timing
def _timed(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def measure(case: Case, ctx: Context, suite: str = "") -> list[Row]:
    """Time every impl of ``case`` side by side (see the module docstring); one row each."""
    import torch

    def row(impl: Impl, **kw) -> Row:
        return Row(suite=suite, case=case.name, impl=impl.name, flops=case.flops,
                   bytes=case.bytes, items=case.items, item_unit=case.item_unit,
                   metric=case.metric, baseline=case.baseline, peak=case.peak,
                   params=dict(case.params), note=impl.note or case.note, **kw)

    rows: dict[str, Row] = {}
    live: dict[str, Callable[[], object]] = {}
    with torch.no_grad():
        for impl in case.impls:
            if not ctx.impl_selected(impl.name):
                continue
            try:
                fn = impl.make()
                live[impl.name] = fn
                rows[impl.name] = row(impl)
                extra = getattr(fn, "note", "")
                if extra:
                    rows[impl.name].note = "; ".join(x for x in (rows[impl.name].note, extra) if x)
            except Skip as e:
                rows[impl.name] = row(impl, status="skipped", reason=str(e))
            except Exception as e:  # noqa: BLE001 — reported, never hidden
                rows[impl.name] = row(impl, status="error", reason=f"{type(e).__name__}: {e}")

        per_call: dict[str, float] = {}
        for name, fn in list(live.items()):  # first call alone: memory, and compile if lazy
            try:
                out, first, mem = call_with_memory(fn, ctx.measure_memory)
                rows[name].mem_bytes = mem
                verify = getattr(fn, "verify", None)
                if verify is not None:
                    rows[name].check = verify(out)
                del out
                # warm-up: ~0.2 s in all, at least one more call unless the first took > 0.5 s
                t, warm, n = first, first, 0
                while n < (first < 0.5) or warm < min(0.2, ctx.min_time / 4):
                    t = _timed(fn, 1)
                    warm, n = warm + t, n + 1
                per_call[name] = t
            except Exception as e:  # noqa: BLE001
                rows[name].status, rows[name].reason = "error", f"{type(e).__name__}: {e}"
                del live[name]

        batch = {n: max(1, round(ctx.sample_time / max(t, 1e-7))) for n, t in per_call.items()}
        samples: dict[str, list[float]] = {n: [] for n in live}
        spent = dict.fromkeys(live, 0.0)
        t_start = time.perf_counter()
        while live:
            for name in list(live):
                try:
                    s = _timed(live[name], batch[name])
                except Exception as e:  # noqa: BLE001
                    rows[name].status, rows[name].reason = "error", f"{type(e).__name__}: {e}"
                    del live[name]
                    continue
                samples[name].append(s)
                spent[name] += s * batch[name]
                if ctx.settle:  # XLA's pool spins after a call and would slow the next impl
                    time.sleep(ctx.settle)
            n_min = min((len(samples[n]) for n in live), default=0)
            enough = n_min >= ctx.repeat and all(spent[n] >= ctx.min_time for n in live)
            over = time.perf_counter() - t_start > ctx.max_case_time and n_min >= 3
            if enough or over:
                break
        live.clear()  # drop inputs before the next case
        if case.teardown is not None:
            case.teardown()
    load = _load1()

    for name, ss in samples.items():
        r = rows[name]
        r.load = load
        if r.status != "ok" or not ss:
            continue
        r.seconds = statistics.median(ss)
        r.samples, r.calls = len(ss), len(ss) * batch[name]
        if len(ss) >= 4:
            q = statistics.quantiles(ss, n=4)
            r.spread = (q[2] - q[0]) / 2 / r.seconds
        elif len(ss) >= 2:  # too few samples for quartiles: half the range
            r.spread = (max(ss) - min(ss)) / 2 / r.seconds
    finish(list(rows.values()), ctx)
    return list(rows.values())


def finish(rows: list[Row], ctx: Context) -> None:
    """Fill the derived columns: ratio to the case's baseline, % of the named peak."""
    by_case = {(r.suite, r.case, r.impl): r for r in rows}
    for r in rows:
        base = by_case.get((r.suite, r.case, r.baseline)) if r.baseline else None
        if r.ok and base is not None and base.ok:
            r.ratio = base.seconds / r.seconds
        peak = ctx.peaks.get(r.peak) if r.peak else None
        if peak is None or not peak.value:
            continue
        rate = r.gbs if peak.unit == "GB/s" else r.gflops
        if rate is not None:
            r.pct_peak = 100.0 * rate / peak.value


def skipped_suite(suite: str, reason: str) -> Row:
    """The row standing for a whole suite that could not run."""
    return Row(suite=suite, case="(suite)", impl="-", status="skipped", reason=reason)
