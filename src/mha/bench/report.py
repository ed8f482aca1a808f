"""Showing and saving a benchmark run: rich tables, JSON and markdown (the plot:
:mod:`mha.bench.plot`).

A run is ``{"meta": {...}, "peaks": {key: Peak fields}, "rows": [Row.to_dict(), ...]}``; the
JSON is the source of truth, and markdown and the plot can be regenerated from it
(``mha bench --from-json ... --markdown ... --headline ...``). ``meta.cpu_info`` is the CPU
record (:mod:`mha.bench.cpu`); its ``kind`` names the files (``latest-<kind>.json``) and the
markdown sections that keep the latest figures of each kind of machine apart.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path

from mha.bench import cpu
from mha.bench.core import Row

_RATE_UNIT = {"gflops": "GFLOP/s", "gbs": "GB/s", "time": "s"}
MD_BEGIN, MD_END = "<!-- mha-bench:begin -->", "<!-- mha-bench:end -->"
HEAD_BEGIN, HEAD_END = "<!-- mha-bench:headline:begin -->", "<!-- mha-bench:headline:end -->"


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs" if seconds >= 1e-5 else f"{seconds * 1e6:.1f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return ""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}" if n < 10 * size else f"{n / size:.0f} {unit}"
    return f"{n} B"


def rate_unit(r: Row) -> str:
    return f"{r.item_unit or 'items'}/s" if r.metric == "items" else _RATE_UNIT[r.metric]


def fmt_rate(r: Row) -> str:
    v = r.rate()
    if v is None:
        return ""
    if r.metric == "time":
        return fmt_time(v)
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.3g}"


def _status(r: Row) -> str:
    return r.reason if r.status == "skipped" else f"ERROR {r.reason}" if r.status == "error" else ""


def by_suite(rows: list[Row]) -> OrderedDict:
    out: OrderedDict = OrderedDict()
    for r in rows:
        out.setdefault(r.suite, OrderedDict()).setdefault(r.case, []).append(r)
    return out


# ----------------------------------------------------------------------------- rich
def print_tables(rows: list[Row], peaks: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    pk = Table(title="machine peaks (measured in this run)", show_lines=False)
    for col in ("peak", "value", "how"):
        pk.add_column(col, overflow="fold")
    for p in peaks.values():
        pk.add_row(escape(p.label), "n/a" if p.value is None else f"{p.value:.0f} {p.unit}",
                   escape(p.how))
    console.print(pk)
    for suite, cases in by_suite(rows).items():
        t = Table(title=f"suite {suite}", show_lines=False)
        for col, just in (("case", "left"), ("impl", "left"), ("time", "right"),
                          ("± %", "right"), ("rate", "right"), ("× base", "right"),
                          ("% peak", "right"), ("mem", "right"), ("note", "left")):
            t.add_column(col, justify=just, overflow="fold")
        for case, rs in cases.items():
            for i, r in enumerate(rs):
                ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
                if r.impl == r.baseline and r.ok:
                    ratio = "1 (base)"
                # escape: a note such as "pip install 'mha[jax]'" is text, not rich markup
                t.add_row(escape(case) if i == 0 else "", escape(r.impl), fmt_time(r.seconds),
                          "" if r.spread is None else f"{100 * r.spread:.0f}",
                          f"{fmt_rate(r)} {rate_unit(r)}" if r.ok else "",
                          ratio, "" if r.pct_peak is None else f"{r.pct_peak:.0f}",
                          fmt_bytes(r.mem_bytes), escape(_status(r) or r.note),
                          style=None if r.ok else "dim")
            t.add_section()
        console.print(t)


# ----------------------------------------------------------------------------- JSON
def latest_path(run: dict, out_dir: Path, suffix: str) -> Path:
    """``out_dir/latest-<kind>.<suffix>``: the latest run of the run's CPU kind."""
    return Path(out_dir) / f"latest-{cpu.of_run(run)['kind']}.{suffix}"


def save_json(run: dict, out_dir: Path, stamp: str) -> list[Path]:
    """Write the run as ``latest-<kind>.json`` (replacing the previous run of that CPU kind
    only) and ``bench-<stamp>-<kind>.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(run, indent=1, default=str)
    paths = [latest_path(run, out_dir, "json"),
             out_dir / f"bench-{stamp}-{cpu.of_run(run)['kind']}.json"]
    for p in paths:
        p.write_text(text + "\n")
    return paths


def load_json(path: Path) -> dict:
    """A saved run, checked by :func:`check_run` (ValueError: not JSON, or not a run)."""
    run = json.loads(Path(path).read_text(encoding="utf-8"))
    check_run(run)
    return run


_NUMBER_FIELDS = ("seconds", "spread", "flops", "bytes", "items", "mem_bytes", "ratio",
                  "pct_peak", "load")


def check_run(run) -> None:
    """Raise ValueError, naming the first bad entry, unless ``run`` has the shape of a saved
    run (what :func:`save_json` writes) that the tables, markdown and plot can read."""
    def need(cond: bool, what: str, got) -> None:
        if not cond:
            raise ValueError(f"not a saved mha bench run: {what}, got {_short(repr(got), 40)}")

    def number(x) -> bool:  # NaN and infinities are no measurement (json reads them)
        return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool)
                             and math.isfinite(x))

    need(isinstance(run, dict), "the top level must be an object", type(run).__name__)
    for key, kind, name in (("meta", dict, "object"), ("peaks", dict, "object"),
                            ("rows", list, "array")):
        need(isinstance(run.get(key), kind), f"{key!r} must be a JSON {name}", run.get(key))
    if "cpu_info" in run["meta"]:
        try:
            cpu.check_record(run["meta"]["cpu_info"])
        except ValueError as e:
            raise ValueError(f"not a saved mha bench run: {e}") from None
    need(run["meta"].get("cpu") is None or isinstance(run["meta"]["cpu"], str),
         "meta.cpu must be a string", run["meta"].get("cpu"))
    for key, p in run["peaks"].items():
        need(isinstance(p, dict) and set(p) <= {"key", "label", "value", "unit", "how"}
             and {"key", "label", "value"} <= set(p), f"peaks[{key!r}] must be an object with "
             "key, label, value (unit, how)", p)
        need(number(p["value"]), f"peaks[{key!r}].value must be a finite number or null", p["value"])
        need(all(isinstance(p.get(k, ""), str) for k in ("label", "unit", "how")),
             f"peaks[{key!r}]: label, unit and how must be strings", p)
    for i, r in enumerate(run["rows"]):
        need(isinstance(r, dict), f"rows[{i}] must be an object", r)
        for k in ("suite", "case", "impl"):
            need(isinstance(r.get(k), str), f"rows[{i}].{k} must be a string", r.get(k))
        need(r.get("metric", "gflops") in ("gflops", "gbs", "items", "time"),
             f"rows[{i}].metric must be gflops, gbs, items or time", r.get("metric"))
        need(r.get("status", "ok") in ("ok", "skipped", "error"),
             f"rows[{i}].status must be ok, skipped or error", r.get("status"))
        for k in _NUMBER_FIELDS:
            need(number(r.get(k)), f"rows[{i}].{k} must be a finite number or null", r.get(k))
        need(r.get("seconds") is None or r["seconds"] > 0, f"rows[{i}].seconds must be > 0 "
             "(a time per call) or null", r.get("seconds"))
        for k in ("reason", "item_unit", "note", "check"):
            need(isinstance(r.get(k, ""), str), f"rows[{i}].{k} must be a string", r.get(k))
        for k in ("baseline", "peak"):
            need(r.get(k) is None or isinstance(r[k], str), f"rows[{i}].{k} must be a string "
                 "or null", r.get(k))
        need(isinstance(r.get("params", {}), dict), f"rows[{i}].params must be an object",
             r.get("params"))


def rows_from_run(run: dict) -> list[Row]:
    fields = set(Row.__dataclass_fields__)
    return [Row(**{k: v for k, v in d.items() if k in fields}) for d in run["rows"]]


# ----------------------------------------------------------------------------- markdown
def _short(reason: str, n: int = 60) -> str:
    reason = reason.replace("|", "/").replace("\n", " ")
    return reason if len(reason) <= n else reason[: n - 1] + "…"


def markdown(run: dict) -> str:
    """The results as markdown: the CPU, the peaks, one ratio matrix per suite, then the full
    rows (a ``###`` section, its suites ``####``)."""
    rows = rows_from_run(run)
    meta = run["meta"]
    lines = [f"### CPU kind `{cpu.of_run(run)['kind']}`", "", cpu.describe(cpu.of_run(run)) + ".",
             "",
             f"Run of {_day(meta)}, `{meta.get('command', 'mha bench')}`, "
             f"{meta.get('threads', '?')} threads; load average "
             f"{meta.get('load_start', '?')} → {meta.get('load_end', '?')} "
             f"(the machine is shared: see the ± column). Commit {meta.get('git') or '?'}; "
             f"torch {meta.get('torch', '?')}, "
             f"onnxruntime {meta.get('onnxruntime', '-')}, jax {meta.get('jax', '-')}.", "",
             "| peak | value | how |", "|---|---|---|"]
    for p in run["peaks"].values():
        v = "n/a" if p["value"] is None else f"{p['value']:.0f} {p['unit']}"
        lines.append(f"| {p['label']} | {v} | {p['how']} |")
    for suite, cases in by_suite(rows).items():
        impls = list(OrderedDict.fromkeys(r.impl for rs in cases.values() for r in rs))
        bases = ", ".join(OrderedDict.fromkeys(r.baseline for rs in cases.values() for r in rs
                                               if r.baseline))
        lines += ["", f"#### Suite `{suite}`", "", f"Rate in the unit shown; in brackets the speed "
                  f"relative to the case's baseline ({bases or 'none'}), > 1 is faster.", "",
                  "| case | unit | " + " | ".join(impls) + " |", "|---" * (len(impls) + 2) + "|"]
        for case, rs in cases.items():
            got = {r.impl: r for r in rs}
            unit = next((rate_unit(r) for r in rs if r.ok), "")
            cells = []
            for name in impls:
                r = got.get(name)
                if r is None:
                    cells.append("")
                elif r.ok:
                    ratio = "" if r.ratio is None else f" ({r.ratio:.2f}×)"
                    cells.append(f"{fmt_rate(r)}{ratio}")
                else:
                    cells.append("skip" if r.status == "skipped" else "error")
            lines.append(f"| {case} | {unit} | " + " | ".join(cells) + " |")
        lines += ["", "<details><summary>every row: time, spread, % of peak, memory, notes"
                  "</summary>", "",
                  "| case | impl | time | ± % | rate | × base | % peak | peak mem | note, check |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for case, rs in cases.items():
            for r in rs:
                lines.append(
                    f"| {case} | {r.impl} | {fmt_time(r.seconds)} | "
                    f"{'' if r.spread is None else f'{100 * r.spread:.0f}'} | "
                    f"{fmt_rate(r) + ' ' + rate_unit(r) if r.ok else ''} | "
                    f"{'' if r.ratio is None else f'{r.ratio:.2f}'} | "
                    f"{'' if r.pct_peak is None else f'{r.pct_peak:.1f}'} | "
                    f"{fmt_bytes(r.mem_bytes)} | "
                    f"{_short('; '.join(x for x in (_status(r), r.note, r.check) if x), 120)} |")
        lines += ["", "</details>"]
    return "\n".join(lines) + "\n"


def mha_row(rows: list[Row]) -> Row | None:
    """The row that speaks for mha in a case: auto dispatch, the module, or the cache loop
    (not a forced backend ``mha:<name>``)."""
    return next((r for r in rows if r.impl.startswith("mha") and not r.impl.startswith("mha:")),
                None)


def is_peer(r: Row) -> bool:
    """Another library's implementation (not mha's, not a memory-read probe)."""
    return not r.impl.startswith(("mha", "read ")) and r.ok and r.rate() is not None


def headline(run: dict) -> str:
    """One line per case: mha's rate, its ratio to the case's baseline, and to the fastest
    other implementation measured in the same run (the README's summary)."""
    rows = rows_from_run(run)
    meta = run["meta"]
    lines = [f"**{cpu.describe(cpu.of_run(run))}.**", "",
             f"`{meta.get('command', 'mha bench')}`, run of {_day(meta)}, "
             f"{meta.get('threads', '?')} threads, load "
             f"{meta.get('load_start', '?')} → {meta.get('load_end', '?')}. Ratios > 1: mha is "
             "faster; every figure comes from one process, implementations interleaved.", "",
             "| suite | case | mha | rate | % of peak | × baseline | fastest other "
             "| × fastest other |", "|---|---|---|---|---|---|---|---|"]
    for suite, cases in by_suite(rows).items():
        for case, rs in cases.items():
            mine = mha_row(rs)
            if mine is None or not mine.ok or mine.rate() is None:
                continue
            higher_is_better = mine.metric != "time"
            peers = [r for r in rs if is_peer(r)]
            best = (max if higher_is_better else min)(peers, key=Row.rate, default=None)
            vs_best = "" if best is None else f"{best.seconds / mine.seconds:.2f}"
            base = "" if mine.ratio is None else f"{mine.ratio:.2f} ({mine.baseline})"
            pct = "" if mine.pct_peak is None else f"{mine.pct_peak:.0f} % ({mine.peak})"
            lines.append(f"| {suite} | {case} | {mine.impl} | {fmt_rate(mine)} "
                         f"{rate_unit(mine)} | {pct} | {base} | {best.impl if best else ''} | "
                         f"{vs_best} |")
    return "\n".join(lines) + "\n"


def _kind_markers(begin: str, end: str, kind: str) -> tuple[str, str]:
    """``<!-- mha-bench:begin -->`` -> ``<!-- mha-bench:begin epyc-zen3-avx2 -->`` (and the end)."""
    return begin[:-4] + f" {kind} -->", end[:-4] + f" {kind} -->"


def write_markdown(run: dict, path: Path, *, headline_only: bool = False,
                   plot_link: str | None = None) -> None:
    """Put the run into ``path`` between the markers: the full tables, or with
    ``headline_only`` the one-line-per-case summary. Between the markers, each CPU kind has
    its own section (its own markers, e.g. ``<!-- mha-bench:begin epyc-zen3-avx2 -->``): the run
    replaces the section of its kind only, or is added after the others. Text between the
    outer markers that belongs to no kind's section (the single-section form) is replaced.
    Without the outer markers the block is appended to the file. ``plot_link``: a path to
    the run's plot, shown at the end of the section."""
    begin, end = (HEAD_BEGIN, HEAD_END) if headline_only else (MD_BEGIN, MD_END)
    kind = cpu.of_run(run)["kind"]
    k_begin, k_end = _kind_markers(begin, end, kind)
    body = headline(run) if headline_only else markdown(run)
    if plot_link:
        body += f"\n![mha bench, {kind}]({plot_link})\n"
    section = f"{k_begin}\n{body}{k_end}"
    path = Path(path)
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old.split(begin, 1)[1]:
        head, rest = old.split(begin, 1)
        inner, tail = rest.split(end, 1)
    else:
        head, inner, tail = (old + "\n" if old else ""), "", "\n"
    if k_begin in inner and k_end in inner.split(k_begin, 1)[1]:
        before, rest = inner.split(k_begin, 1)
        inner = before + section + rest.split(k_end, 1)[1]
    elif begin[:-4] + " " in inner:  # other kinds' sections: keep them
        inner = inner.rstrip("\n") + "\n\n" + section + "\n"
    else:
        inner = "\n" + section + "\n"
    path.write_text(head + begin + inner + end + tail)


def _day(meta: dict) -> str:
    """The run's date (the JSON keeps the full UTC start; the docs name the day only)."""
    return str(meta.get("started", "?")).split(" ")[0]
