"""``mha experiment heads``: the seeds' head-count experiment (seed 003), run for real.

Trains small transformers at a fixed d_model for every h dividing d_model, on synthetic tasks,
with several seeds; prints a table, writes ``results.json``, a Markdown table and a PNG plot.
``--from-results`` re-renders the table and plot from an earlier ``results.json``.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("experiment", help="experiments with multi-head attention (heads: the "
                       "head-count sweep of seed 003)")
    which = p.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    h = which.add_parser("heads", help="train small transformers sweeping num_heads at fixed "
                         "d_model; table, results.json, plot")
    size = h.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="every head count, 1 seed, short training (a few minutes)")
    size.add_argument("--tiny", action="store_true",
                      help="2 head counts, d_model 16, a few steps (seconds; what the tests run)")
    h.add_argument("--out", default="experiment-heads",
                   help="output directory (default: %(default)s)")
    h.add_argument("--seeds", type=int, help="random seeds per point (overrides the preset)")
    h.add_argument("--steps", type=int, help="training steps per run (overrides the preset)")
    h.add_argument("--d-model", type=int, help="model width (overrides the preset)")
    h.add_argument("--layers", type=int, help="transformer blocks (overrides the preset)")
    h.add_argument("--heads", type=int, nargs="+", help="head counts (default: every divisor "
                   "of d_model)")
    h.add_argument("--tasks", nargs="+", help="tasks: lags, recall, markov")
    h.add_argument("--markdown", metavar="FILE", help="also write the Markdown table to FILE "
                   "(only between the heads-table markers when FILE has them)")
    h.add_argument("--section", metavar="NAME", help="with --markdown: fill the "
                   "heads-table:NAME markers instead of the unnamed ones")
    h.add_argument("--from-results", metavar="JSON", help="do not train: render the table, "
                   "plot and Markdown from this results.json")
    h.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from mha.experiments import heads, report

    con = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_results:
        results = report.load(args.from_results)
    else:
        name = "tiny" if args.tiny else "quick" if args.quick else "full"
        cfg = heads.preset(name, seeds=args.seeds, steps=args.steps, d_model=args.d_model,
                           n_layers=args.layers,
                           heads=tuple(args.heads) if args.heads else None,
                           tasks=tuple(args.tasks) if args.tasks else None)
        cfg.validate()
        n_runs = len(cfg.tasks) * len(cfg.head_counts()) * cfg.seeds
        con.print(f"[bold]mha experiment heads[/bold] ({cfg.preset}): d_model={cfg.d_model}, "
                  f"{cfg.n_layers} layers, h in {list(cfg.head_counts())}, tasks "
                  f"{list(cfg.tasks)}, {cfg.seeds} seed(s), {cfg.steps} steps -> {n_runs} runs")

        def log(rec: dict, so_far: dict) -> None:
            report.save(so_far, out / "results.json")  # partial results survive a stop
            m = rec["metrics"]
            con.print(f"{rec['task']:>7} h={rec['num_heads']:<3} d_k={rec['head_dim']:<3} "
                      f"seed={rec['seed']}  params={rec['params']['total']:,} "
                      f"(attention {rec['params']['attention']:,})  backend={rec['backend']}  "
                      f"loss {m['init_loss']:.3f} -> {m['final_loss']:.3f}  "
                      f"acc {100 * m['final_acc']:.1f}%  {rec['time_s']:.1f}s")

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TimeRemainingColumn())
        with Progress(*columns, console=con, transient=True) as progress:
            results = heads.run_sweep(cfg, progress=progress, log=log)
        report.save(results, out / "results.json")
    for table in report.rich_tables(results):
        con.print(table)
    report.write_markdown(results, out / "table.md")
    if args.markdown:
        report.write_markdown(results, args.markdown, section=args.section)
    report.plot(results, out / "heads.png")
    report.plot_curves(results, out / "curves.png")
    written = [] if args.from_results else [out / "results.json"]
    written += [out / "table.md", out / "heads.png", out / "curves.png"]
    con.print("wrote " + ", ".join(map(str, written)))
    return 0

