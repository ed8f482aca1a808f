"""``mha bench``: mha's backends against the peers, side by side in one process.

Measures this machine's peaks, runs the suites (``mha.bench.<name>``; see
``mha.bench.core`` for how to add one), prints tables, and writes, under ``--out``, the latest
run of this CPU kind (``latest-<kind>.json`` and ``latest-<kind>.png``; the kind, e.g.
``epyc-zen3-avx2``, comes from the CPU record, ``mha.bench.cpu``) and a timestamped copy.
``--markdown FILE`` writes the tables into FILE between ``<!-- mha-bench:begin/end -->``
markers, in the section of this CPU kind (other kinds' sections are kept); ``--from-json``
redoes the outputs from a saved run without measuring.
"""

from __future__ import annotations

import argparse

from mha.cli.options import (
    UsageError,
    check_editable_text,
    check_option,
    cpus,
    json_problem,
    nonnegative_float,
    output_dir,
    output_file,
    positive_float,
    positive_int,
    readable_file,
    thread_count,
)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark mha's backends against torch SDPA, naive, "
                       "FlexAttention, ONNX Runtime and JAX (suites: attention, decode, hf, variants, llm)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny grid, short timing (< ~1 min)")
    p.add_argument("--suite", action="append", default=None, metavar="NAME",
                   help="run only this suite (repeatable); default: all of mha.bench.core.SUITES")
    p.add_argument("--filter", action="append", default=[], metavar="TEXT",
                   help="only cases whose name contains TEXT (repeatable: any)")
    p.add_argument("--impl", action="append", default=[], metavar="TEXT",
                   help="only implementations whose name contains TEXT (repeatable: any)")
    p.add_argument("--repeat", type=positive_int, default=None, help="minimum timed samples per impl "
                   "(default 5; quick 3)")
    p.add_argument("--min-time", type=nonnegative_float, default=None, help="minimum seconds of timed "
                   "calls per impl and case (default 0.5; quick 0.1)")
    p.add_argument("--max-case-time", type=positive_float, default=None, help="stop adding rounds to a "
                   "case after this many seconds, keeping >= 3 samples (default 25; quick 5)")
    p.add_argument("--threads", type=thread_count, default=min(2, cpus()),
                   help="threads for every implementation (default 2; at most the logical CPUs)")
    p.add_argument("--mem-budget", type=positive_float, default=3.0, metavar="GIB",
                   help="skip implementations that would allocate more than this (GiB)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory probe")
    p.add_argument("--out", default="benchmarks/results", help="directory for "
                   "latest-<cpu kind>.json, bench-<time>-<cpu kind>.json and latest-<cpu kind>.png "
                   "('' to save nothing)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    p.add_argument("--markdown", metavar="FILE", type=output_file, help="write the tables into FILE (between "
                   "markers, this CPU kind's section only; e.g. docs/benchmarks.md)")
    p.add_argument("--headline", metavar="FILE", type=output_file, help="write a one-line-per-case summary (mha "
                   "vs baseline vs fastest other) into FILE between its own markers, this CPU "
                   "kind's section only (README.md)")
    p.add_argument("--from-json", metavar="FILE", type=readable_file, help="do not measure: print/redo outputs "
                   "from a saved run")
    p.add_argument("--list", action="store_true", help="list suites and cases, measure nothing")
    p.set_defaults(func=run)


def _versions() -> dict:
    import importlib.metadata as md
    import platform

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("onnxruntime", "onnx", "jax", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _git_commit() -> str | None:
    """The checkout's commit, with "+dirty: files" when tracked files under src/ were modified
    (the run measured the working tree, not exactly the commit)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                "src"], capture_output=True, text=True, timeout=5).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    files = [f for f in dirty if "/" in f]
    return (head + (f" +dirty: {', '.join(files)}" if files else "")) or None


def _collect(ctx, names, console):
    """``[(suite, module or None, skip reason, cases or None)]`` for the chosen suites."""
    from mha.bench.core import load_suite

    plan = []
    for name in names:
        mod, why = load_suite(name)
        if mod is None:
            plan.append((name, None, why, None))
        elif hasattr(mod, "cases"):
            try:
                cs = [c for c in mod.cases(ctx) if ctx.selected(c.name)]
                plan.append((name, mod, None, cs))
            except Exception as e:  # noqa: BLE001 — one broken suite must not stop the rest
                plan.append((name, None, f"{name}.cases() failed: {type(e).__name__}: {e}",
                             None))
        else:
            plan.append((name, mod, None, None))
    return plan


def check(args: argparse.Namespace) -> tuple[list[str], dict | None]:
    """Refuse a bad command before any work: unknown suites, a saved run that cannot be read,
    an output directory that cannot be written. Returns the suite names to run and the saved
    run of ``--from-json`` (None without it)."""
    from mha.bench import report
    from mha.bench.core import SUITES, check_suite

    for name in args.suite or ():
        try:
            check_suite(name)
        except ValueError as e:
            raise UsageError(f"--suite: {e}") from None
    twice = sorted({n for n in args.suite or () if args.suite.count(n) > 1})
    if twice:  # it would run (and record) the suite twice
        raise UsageError(f"--suite {twice[0]!r} is given more than once")
    if args.out and not args.list:
        check_option("--out", output_dir, args.out)
    check_editable_text("--markdown", args.markdown)
    check_editable_text("--headline", args.headline)
    saved = None
    if args.from_json:
        try:
            saved = report.load_json(args.from_json)
        except ValueError as e:  # not UTF-8, not JSON, or not a run
            raise UsageError(f"--from-json {str(args.from_json)!r}: {json_problem(e)}") from None
    return list(args.suite or SUITES), saved


def check_forcing() -> None:
    """Raise the refusal (ValueError or RuntimeError, :mod:`mha.ops.forcing`'s words) of the
    first forcing variable set to a value this build / CPU / OS cannot run: a run records the
    kernels it measured. The C++ ones are asked of their kernel's read-back (built when
    needed); a kernel that cannot be built has no choice to check (the run records why)."""
    import os

    from mha.ops import forcing

    if "MHA_AMX_EMULATE" in os.environ:
        forcing.amx_emulate(os.environ["MHA_AMX_EMULATE"])
    if "MHA_LINEAR" in os.environ:
        from mha.ops import linear_choice

        linear_choice.forced()
    if "MHA_FLASH_BF16" in os.environ:
        from mha.ops import flash

        if flash.unavailable() is None:
            flash.kernels()
    if "MHA_DECODE_BF16" in os.environ:
        from mha.ops import decode

        if decode.unavailable() is None:
            decode.bf16_qk()


def _check_filter(args: argparse.Namespace, plan, ctx) -> None:
    """``--filter`` that selects no case at all is a typo, not a run of nothing (only decidable
    when every suite lists its cases: ``cases(ctx)``, or ``all_cases(ctx)`` for a suite that
    measures by itself; both build cases without measuring)."""
    if not args.filter:
        return
    listed = []
    for _, mod, _, cs in plan:
        if mod is None:
            continue
        if cs is None and hasattr(mod, "all_cases"):
            try:
                cs = [c for c in mod.all_cases(ctx) if ctx.selected(c.name)]
            except Exception:  # noqa: BLE001 - the suite's run reports it; undecidable here
                cs = None
        listed.append(cs)
    if listed and all(cs is not None and not cs for cs in listed):
        raise UsageError(f"--filter {' '.join(map(repr, args.filter))} matches no case of the "
                         f"chosen suites (mha bench --list shows them)")


def run(args: argparse.Namespace) -> int:
    """Check the command, then: list, redo outputs from a saved run, or measure, record and
    report. Exit status 1 when a row is an error."""
    import sys

    from rich.console import Console

    from mha.threads import num_threads

    names, saved = check(args)
    # Piped output (make bench | tee, CI logs): wide enough for the tables.
    console = Console() if sys.stdout.isatty() else Console(width=170)
    if saved is not None:
        return _report_saved(saved, args, console)
    check_forcing()  # a forcing that cannot run: refused before any measuring
    with num_threads(args.threads):  # run in-process (mha.cli.main), the caller's count comes back
        return _run(args, names, console)


def _run(args: argparse.Namespace, names: list[str], console) -> int:
    ctx = _context(args)
    plan = _collect(ctx, names, console)
    _check_filter(args, plan, ctx)
    if args.list:
        _print_plan(plan, console)
        return 0
    clock = _Clock.start()
    rows = _measure(plan, ctx, args.threads, console)
    run_data = _record(rows, ctx, args, clock)
    _report(run_data, rows, ctx.peaks, args, console)
    return 0 if not any(r.status == "error" for r in rows) else 1


def _report_saved(run_data: dict, args: argparse.Namespace, console) -> int:
    """``--from-json``: the tables and outputs of a saved run, nothing measured."""
    from mha.bench import report
    from mha.bench.peaks import Peak

    peaks = {k: Peak(**v) for k, v in run_data["peaks"].items()}
    report.print_tables(report.rows_from_run(run_data), peaks, console)
    _write_outputs(run_data, args, console, save=False)
    return 0


def _context(args: argparse.Namespace):
    """The suites' settings from the options (``--quick`` changes the defaults)."""
    from mha.bench.core import Context

    q = args.quick
    return Context(quick=q, filter=tuple(args.filter), impl_filter=tuple(args.impl),
                   repeat=args.repeat or (3 if q else 5),
                   min_time=args.min_time if args.min_time is not None else (0.1 if q else 0.5),
                   sample_time=0.01 if q else 0.03,
                   max_case_time=args.max_case_time or (5.0 if q else 25.0),
                   mem_budget=args.mem_budget * 2**30, measure_memory=not args.no_memory)


def _print_plan(plan, console) -> None:
    """``--list``: the suites, their cases and implementations."""
    for name, mod, why, cs in plan:
        console.print(f"[bold]{name}[/bold]: " + (f"skipped — {why}" if why else
                                                   getattr(mod, "TITLE", "")))
        for c in cs or []:
            console.print(f"  {c.name}: " + ", ".join(i.name for i in c.impls))
        if mod is not None and cs is None:
            console.print("  (measures by itself: run(ctx))")


class _Clock:
    """When the run started (UTC), the load average then, and the timer."""

    def __init__(self, started, load_start: float, t0: float):
        self.started, self.load_start, self.t0 = started, load_start, t0

    @classmethod
    def start(cls) -> _Clock:
        import os
        import time
        from datetime import datetime, timezone

        return cls(datetime.now(timezone.utc), os.getloadavg()[0], time.perf_counter())

    def seconds(self) -> float:
        import time

        return round(time.perf_counter() - self.t0, 1)


def _measure(plan, ctx, threads: int, console) -> list:
    """The peaks (into ``ctx.peaks``), then every planned suite, with a progress bar; a suite
    that cannot run or fails is one skipped row. Returns the rows, derived columns filled."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mha.bench.core import finish, skipped_suite
    from mha.bench.peaks import measure_peaks

    with console.status("measuring this machine's peaks..."):
        ctx.peaks = measure_peaks(threads, quick=ctx.quick)
    rows: list = []
    total = sum(len(cs) if cs is not None else 1 for _, mod, _, cs in plan if mod is not None)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as prog:
        task = prog.add_task("bench", total=total)
        for name, mod, why, cs in plan:
            if mod is None:
                rows.append(skipped_suite(name, why))
            elif cs is None:
                prog.update(task, description=f"{name}: run(ctx)")
                rows += _run_suite(name, mod, ctx)
                prog.advance(task)
            else:
                for c in cs:
                    prog.update(task, description=f"{name}: {c.name}")
                    rows += _measure_case(name, c, ctx, prog.console)
                    prog.advance(task)
    finish(rows, ctx)
    return rows


def _run_suite(name: str, mod, ctx) -> list:
    """A suite that measures by itself (``run(ctx)``); its failure is one skipped row."""
    from mha.bench.core import skipped_suite

    try:
        got = list(mod.run(ctx))
        for r in got:
            r.suite = r.suite or name
    except Exception as e:  # noqa: BLE001 — one broken suite must not stop the rest
        return [skipped_suite(name, f"{name}.run() failed: {type(e).__name__}: {e}")]
    return got


def _measure_case(name: str, case, ctx, console) -> list:
    """One case through the harness, and a progress line."""
    import time

    t_case = time.perf_counter()
    got = ctx.measure(case, suite=name)
    console.print(f"{name}: {case.name}: {sum(r.ok for r in got)}/{len(got)} measured in "
                  f"{time.perf_counter() - t_case:.0f} s", highlight=False)
    return got


def _record(rows: list, ctx, args: argparse.Namespace, clock: _Clock) -> dict:
    """The run as saved: settings, load, versions, the CPU record, the peaks and the rows."""
    import os
    import sys

    from mha.bench import cpu

    machine = cpu.record()
    return {
        "meta": {"started": clock.started.strftime("%Y-%m-%d %H:%M:%S"),
                 "seconds": clock.seconds(),
                 "command": "mha bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 1
                            else "mha bench",
                 "threads": args.threads, "quick": ctx.quick, "git": _git_commit(),
                 "load_start": round(clock.load_start, 2),
                 "load_end": round(os.getloadavg()[0], 2),
                 "settings": {"repeat": ctx.repeat, "min_time": ctx.min_time,
                              "sample_time": ctx.sample_time, "max_case_time": ctx.max_case_time,
                              "mem_budget_gib": args.mem_budget,
                              "filter": list(ctx.filter), "impl": list(ctx.impl_filter)},
                 "env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OMP_NUM_THREADS",
                                                        "MKL_NUM_THREADS")},
                 **_versions(), "cpu": machine["model_name"], "cpu_info": machine},
        "peaks": {k: vars(p) for k, p in ctx.peaks.items()},
        "rows": [r.to_dict() for r in rows],
    }


def _report(run_data: dict, rows: list, peaks: dict, args: argparse.Namespace, console) -> None:
    """A measured run: the tables, the time taken, then the files."""
    from mha.bench import report

    report.print_tables(rows, peaks, console)
    console.print(f"took {run_data['meta']['seconds']:.0f} s")
    _write_outputs(run_data, args, console, save=True)


def _write_outputs(run_data: dict, args: argparse.Namespace, console, *, save: bool) -> None:
    """Under ``--out``: the JSON (``save``: a measured run) and the plot of the run's CPU kind;
    then this kind's sections of ``--markdown`` and ``--headline``."""
    import os
    from pathlib import Path

    from mha.bench import report

    out_dir = Path(args.out) if args.out else None
    png = None
    if out_dir is not None:
        if save:
            stamp = run_data["meta"]["started"].replace("-", "").replace(":", "").replace(" ", "-")
            for p in report.save_json(run_data, out_dir, stamp):
                console.print(f"wrote {p}")
        if not args.no_plot:
            png = _plot(run_data, report.latest_path(run_data, out_dir, "png"), console)
    for path, headline_only, what in ((args.markdown, False, "the tables"),
                                      (args.headline, True, "the one-line-per-case summary")):
        if not path:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        link = None if png is None else Path(os.path.relpath(png, path.parent.resolve())).as_posix()
        report.write_markdown(run_data, path, headline_only=headline_only, plot_link=link)
        console.print(f"wrote {what} into {path}")


def _plot(run_data: dict, path, console):
    """Draw the plot; its absolute path, or None (with the reason printed) when it cannot."""
    from mha.bench.plot import plot

    try:
        got = plot(run_data, path)
    except ImportError as e:
        console.print(f"no plot: {e.name} not installed (pip install 'mha[viz]')")
        return None
    except ValueError as e:  # nothing measured, so nothing to draw
        console.print(f"no plot: {e}")
        return None
    console.print(f"wrote {got}")
    return got.resolve()
