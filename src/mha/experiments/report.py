"""Summaries of a head-count sweep: the rich table, the Markdown table and the PNG plot, all
computed from the ``results.json`` dict (never typed in).

Shape legend: h heads, d_k = d_model / h head dim.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

BEGIN, END = "<!-- heads-table:begin -->", "<!-- heads-table:end -->"


def markers(section: str | None = None) -> tuple[str, str]:
    """The comment lines that delimit a generated table in a document; ``section`` names one
    of several (``<!-- heads-table:NAME:begin -->``)."""
    if section is None:
        return BEGIN, END
    return f"<!-- heads-table:{section}:begin -->", f"<!-- heads-table:{section}:end -->"


def load(path: str | Path) -> dict:
    """A ``results.json``, checked by :func:`check_results` (ValueError: not JSON, or not
    results the tables and plots can read)."""
    results = json.loads(Path(path).read_text(encoding="utf-8"))
    check_results(results)
    return results


def check_results(results) -> None:
    """Raise ValueError, naming the first bad entry, unless ``results`` has the shape that
    :func:`mha.experiments.heads.run_sweep` returns (what the tables and plots read)."""
    def need(cond: bool, what: str, got=None) -> None:
        if not cond:
            shown = repr(got)
            shown = shown if len(shown) <= 40 else shown[:39] + "…"
            raise ValueError(f"not the results of mha experiment heads: {what}, got {shown}")

    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    need(isinstance(results, dict), "the top level must be an object", type(results).__name__)
    for key, kind, name in (("config", dict, "object"), ("tasks", dict, "object"),
                            ("runs", list, "array")):
        need(isinstance(results.get(key), kind), f"{key!r} must be a JSON {name}",
             results.get(key))
    cfg = results["config"]
    for key in ("d_model", "n_layers", "steps", "batch", "lr", "seeds", "eval_size",
                "eval_points"):
        need(number(cfg.get(key)), f"config.{key} must be a number", cfg.get(key))
    need(isinstance(cfg.get("heads"), list), "config.heads must be a list", cfg.get("heads"))
    for task, info in results["tasks"].items():
        need(isinstance(info, dict) and isinstance(info.get("claim"), str)
             and number(info.get("chance_loss")), f"tasks[{task!r}] must be an object with "
             "claim and chance_loss", info)
        need(number(info.get("best_possible_loss", 0)),
             f"tasks[{task!r}].best_possible_loss must be a number", info.get("best_possible_loss"))
        need(isinstance(info.get("n_slots", 1), int) and info.get("n_slots", 1) >= 1,
             f"tasks[{task!r}].n_slots must be a positive int", info.get("n_slots"))
        need(isinstance(info.get("settings", {}), dict), f"tasks[{task!r}].settings must be an "
             "object", info.get("settings"))
    curve_len: dict[str, int] = {}
    for i, r in enumerate(results["runs"]):
        where = f"runs[{i}]"
        need(isinstance(r, dict), f"{where} must be an object", r)
        need(r.get("task") in results["tasks"], f"{where}.task must name one of 'tasks'",
             r.get("task"))
        for key in ("num_heads", "head_dim"):
            need(isinstance(r.get(key), int) and r[key] >= 1, f"{where}.{key} must be a "
                 "positive int", r.get(key))
        need(number(r.get("time_s")) and number(r.get("cpu_s", 0.0)), f"{where}.time_s and "
             "cpu_s must be numbers", r.get("time_s"))
        p = r.get("params")
        need(isinstance(p, dict) and isinstance(p.get("total"), int)
             and isinstance(p.get("attention"), int), f"{where}.params must hold int total and "
             "attention", p)
        need(isinstance(r.get("backend"), str), f"{where}.backend must be a string",
             r.get("backend"))
        m = r.get("metrics")
        need(isinstance(m, dict) and number(m.get("final_loss")) and number(m.get("final_acc")),
             f"{where}.metrics must hold numbers final_loss and final_acc", m)
        info = results["tasks"][r["task"]]
        slots = m.get("final_slot_acc")
        need(isinstance(slots, list) and len(slots) == info.get("n_slots", 1)
             and all(map(number, slots)), f"{where}.metrics.final_slot_acc must be "
             f"{info.get('n_slots', 1)} numbers (the task's n_slots)", slots)
        curve = m.get("eval_curve")
        need(isinstance(curve, list) and len(curve) >= 1
             and all(isinstance(pt, list) and len(pt) == 3 and all(map(number, pt))
                     for pt in curve), f"{where}.metrics.eval_curve must be a list of "
             "[step, loss, accuracy]", curve)
        need(curve_len.setdefault(r["task"], len(curve)) == len(curve),
             f"{where}.metrics.eval_curve must have as many points as the task's other runs",
             len(curve))
    for task, info in results["tasks"].items():
        need(task in curve_len, f"tasks[{task!r}] has no run", task)
        lags = info.get("settings", {}).get("lags")
        need(lags is None or (isinstance(lags, list) and len(lags) == info.get("n_slots", 1)),
             f"tasks[{task!r}].settings.lags must list one lag per slot", lags)


def save(results: dict, path: str | Path) -> None:
    """Write ``results`` as JSON atomically (a reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(path)


def _mean_std(xs: list[float]) -> tuple[float, float]:
    if not all(math.isfinite(x) for x in xs):  # a diverged run (NaN loss): shown as nan
        return sum(xs) / len(xs), (math.nan if len(xs) > 1 else 0.0)  # (statistics raises)
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(results: dict) -> dict[str, list[dict]]:
    """Per task, one row per head count: mean and std over seeds of loss, accuracy, time."""
    out: dict[str, list[dict]] = {}
    for task in results["tasks"]:
        rows = []
        runs = [r for r in results["runs"] if r["task"] == task]
        for h in sorted({r["num_heads"] for r in runs}):
            rs = [r for r in runs if r["num_heads"] == h]
            loss = _mean_std([r["metrics"]["final_loss"] for r in rs])
            acc = _mean_std([r["metrics"]["final_acc"] for r in rs])
            rows.append({"num_heads": h, "head_dim": rs[0]["head_dim"], "n": len(rs),
                         "loss": loss, "acc": acc,
                         "reach": [_first_step(r, REACH) for r in rs],
                         "time": statistics.fmean(r["time_s"] for r in rs),
                         "cpu": statistics.fmean(r.get("cpu_s", float("nan")) for r in rs),
                         "params": sorted({r["params"]["total"] for r in rs}),
                         "attn_params": sorted({r["params"]["attention"] for r in rs}),
                         "backends": sorted({r["backend"] for r in rs}),
                         "slots": [statistics.fmean(col) for col in
                                   zip(*(r["metrics"]["final_slot_acc"] for r in rs),
                                       strict=True)],
                         "captured": _mean_std([sum(a >= CAPTURED for a in
                                                    r["metrics"]["final_slot_acc"])
                                                for r in rs])})
        out[task] = rows
    return out


REACH = 0.95  # "steps to 95 %": the first held-out evaluation at or above this accuracy


def _first_step(run: dict, level: float) -> int | None:
    return next((step for step, _, acc in run["metrics"]["eval_curve"] if acc >= level), None)


def _reach_cell(reach: list[int | None]) -> str:
    done = [s for s in reach if s is not None]
    if not done:
        return "never"
    mean = f"{statistics.fmean(done):.0f}"
    return mean if len(done) == len(reach) else f"{mean} ({len(done)} of {len(reach)} seeds)"


CAPTURED = 0.99  # a relation (lag) counts as captured when its slot accuracy reaches this


def slot_rows(results: dict, task: str) -> tuple[list[str], list[list[str]]]:
    """For a task with several targets per position (``lags``): the columns and rows of a
    table of per-target accuracy by h, and how many relations reach 99 %."""
    info = results["tasks"][task]
    lags = info["settings"].get("lags", range(1, info["n_slots"] + 1))
    cols = ["heads h"] + [f"x(t-{a}) %" for a in lags] + [f"relations ≥ {100 * CAPTURED:.0f} %"]
    rows = []
    for row in summarize(results)[task]:
        m, sd = row["captured"]
        rows.append([str(row["num_heads"])] + [f"{100 * a:.1f}" for a in row["slots"]]
                    + [f"{m:.1f} ± {sd:.1f} of {len(row['slots'])}"])
    return cols, rows


def _multi_slot_tasks(results: dict) -> list[str]:
    return [t for t, info in results["tasks"].items() if info.get("n_slots", 1) > 1]


def _cells(row: dict, best_acc: float) -> list[str]:
    (lm, ls), (am, as_) = row["loss"], row["acc"]
    mark = " *" if abs(am - best_acc) < 1e-12 else ""
    return [str(row["num_heads"]), str(row["head_dim"]), f"{lm:.3f} ± {ls:.3f}",
            f"{100 * am:.1f} ± {100 * as_:.1f}{mark}", _reach_cell(row["reach"]),
            str(row["n"]), f"{row['time']:.1f}",
            f"{row['cpu']:.1f}",
            "/".join(map(str, row["params"])), ", ".join(row["backends"])]


COLUMNS = ("heads h", "head_dim d_k", "final loss (nats)", "accuracy %",
           f"steps to {100 * REACH:.0f} %", "seeds",
           "wall s/run", "CPU s/run", "params", "backend")


def _task_note(results: dict, task: str) -> str:
    info = results["tasks"][task]
    note = f"{task} — {info['claim']}; chance loss {info['chance_loss']:.3f}"
    if "best_possible_loss" in info:
        note += f", best possible loss (source entropy) {info['best_possible_loss']:.3f}"
    return note


def rich_tables(results: dict) -> list:
    """One rich Table per task (mean ± std over seeds; * marks the best mean accuracy)."""
    from rich.table import Table

    tables = []
    for task, rows in summarize(results).items():
        t = Table(title=_task_note(results, task))
        for col in COLUMNS:
            t.add_column(col, justify="right")
        best = max(r["acc"][0] for r in rows)
        for row in rows:
            t.add_row(*_cells(row, best))
        tables.append(t)
    for task in _multi_slot_tasks(results):
        cols, rows = slot_rows(results, task)
        t = Table(title=f"{task}: accuracy of each relation (mean over seeds)")
        for col in cols:
            t.add_column(col, justify="right")
        for row in rows:
            t.add_row(*row)
        tables.append(t)
    return tables


def markdown(results: dict) -> str:
    """The same tables in Markdown, with the configuration they came from."""
    cfg = results["config"]
    lines = [f"Configuration: preset `{cfg['preset']}`, h in {cfg['heads']}, "
             f"d_model={cfg['d_model']}, "
             f"{cfg['n_layers']} layers, {cfg['steps']} steps of batch {cfg['batch']}, "
             f"lr {cfg['lr']}, {cfg['seeds']} seed(s) per point, held-out set of "
             f"{cfg['eval_size']} sequences evaluated {cfg['eval_points']} times along training. "
             f"Mean ± std over seeds; * marks the best mean accuracy; steps to "
             f"{100 * REACH:.0f} % is the first evaluation at that held-out accuracy (mean over "
             f"the seeds that reached it). Wall time is noisy (a shared 2-core machine); "
             f"CPU time is the process's own.",
             ""]
    for task, rows in summarize(results).items():
        lines += [f"**{_task_note(results, task)}**", "",
                  "| " + " | ".join(COLUMNS) + " |",
                  "|" + "---:|" * len(COLUMNS)]
        best = max(r["acc"][0] for r in rows)
        lines += ["| " + " | ".join(_cells(row, best)) + " |" for row in rows]
        lines.append("")
    for task in _multi_slot_tasks(results):
        cols, rows = slot_rows(results, task)
        lines += [f"**{task}: accuracy of each relation (mean over seeds)**", "",
                  "| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    return "\n".join(lines)


def write_markdown(results: dict, path: str | Path, section: str | None = None) -> None:
    """Write the Markdown tables to ``path``; when the file holds the :func:`markers` of
    ``section``, replace only what lies between them (a document regenerated in place)."""
    path = Path(path)
    table = markdown(results)
    begin, end = markers(section)
    if path.exists() and begin in (text := path.read_text()) and end in text:
        new = re.sub(re.escape(begin) + ".*?" + re.escape(end),
                     lambda _: f"{begin}\n{table}\n{end}", text, flags=re.S)
        path.write_text(new)
    elif section is not None and path.exists():
        raise ValueError(f"section: {path} has no {begin} ... {end} markers")
    else:
        path.write_text(table + "\n")


def plot(results: dict, path: str | Path) -> None:
    """Accuracy (top) and loss (bottom) against h on a log-2 axis, one column per task: each
    seed as a dot, the mean as a line with ± std bars."""
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the plot needs matplotlib: pip install 'mha[viz]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(results)
    n = len(summary)
    fig, axes = plt.subplots(2, n, figsize=(4.2 * n, 7), squeeze=False)
    for col, (task, rows) in enumerate(summary.items()):
        info = results["tasks"][task]
        runs = [r for r in results["runs"] if r["task"] == task]
        hs = [r["num_heads"] for r in rows]
        for ax, key, label in ((axes[0][col], "acc", "accuracy"),
                               (axes[1][col], "loss", "final loss (nats)")):
            metric = "final_acc" if key == "acc" else "final_loss"
            ax.scatter([r["num_heads"] for r in runs], [r["metrics"][metric] for r in runs],
                       s=12, alpha=0.45, color="tab:gray", label="one seed")
            ax.errorbar(hs, [r[key][0] for r in rows], yerr=[r[key][1] for r in rows],
                        marker="o", capsize=3, color="tab:blue", label="mean ± std")
            if key == "loss":
                ax.axhline(info["chance_loss"], ls="--", color="tab:red", lw=1, label="chance")
                if "best_possible_loss" in info:
                    ax.axhline(info["best_possible_loss"], ls=":", color="tab:green", lw=1,
                               label="source entropy")
            ax.set_xscale("log", base=2)
            ax.set_xticks(hs, [f"{h}\n(d_k={r['head_dim']})" for h, r in zip(hs, rows, strict=True)],
                          fontsize=7)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0][col].set_title(f"{task}: {info['claim']}", fontsize=10)
        axes[1][col].set_xlabel("num_heads h (log 2)")
        axes[1][col].legend(fontsize=7)
    cfg = results["config"]
    fig.suptitle(f"Head count at fixed width: d_model={cfg['d_model']}, {cfg['n_layers']} layers,"
                 f" {cfg['steps']} steps, {cfg['seeds']} seed(s) per point", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(results: dict, path: str | Path) -> None:
    """Held-out accuracy along training, one line per h (mean over seeds), one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(results["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
    cmap = plt.get_cmap("viridis")
    for ax, task in zip(axes[0], tasks, strict=True):
        runs = [r for r in results["runs"] if r["task"] == task]
        hs = sorted({r["num_heads"] for r in runs})
        for i, h in enumerate(hs):
            curves = [r["metrics"]["eval_curve"] for r in runs if r["num_heads"] == h]
            steps = [p[0] for p in curves[0]]
            acc = [statistics.fmean(c[j][2] for c in curves) for j in range(len(steps))]
            ax.plot(steps, acc, marker=".", color=cmap(i / max(1, len(hs) - 1)), label=f"h={h}")
        ax.set_title(task, fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
