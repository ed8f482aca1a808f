"""``mha experiment heads``: the seeds' head-count experiment (seed 003), run for real.

Trains small transformers at a fixed d_model for every h dividing d_model, on synthetic tasks,
with several seeds; prints a table, writes ``results.json``, a Markdown table and a PNG plot.
``--from-results`` re-renders the table and plot from an earlier ``results.json``.
"""

from __future__ import annotations

import argparse

from mha.cli.options import (
    UsageError,
    check_editable_text,
    check_fits,
    check_outputs,
    json_problem,
    output_dir,
    output_file,
    positive_int,
    readable_file,
    require,
)

# The options that shape a training run (refused with --from-results, which trains nothing).
TRAINING = ("quick", "tiny", "seeds", "steps", "d_model", "layers", "heads", "tasks")
# HeadsConfig's fields -> the options that set them (the other fields come from the preset)
_OPTIONS = {"seeds": "--seeds", "steps": "--steps", "d_model": "--d-model", "n_layers": "--layers",
            "heads": "--heads", "tasks": "--tasks"}


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
    h.add_argument("--out", default="experiment-heads", type=output_dir,
                   help="output directory (default: %(default)s)")
    h.add_argument("--seeds", type=positive_int, help="random seeds per point (overrides the preset)")
    h.add_argument("--steps", type=positive_int, help="training steps per run (overrides the preset)")
    h.add_argument("--d-model", type=positive_int, help="model width (overrides the preset)")
    h.add_argument("--layers", type=positive_int, help="transformer blocks (overrides the preset)")
    h.add_argument("--heads", type=positive_int, nargs="+", help="head counts (default: every divisor "
                   "of d_model)")
    h.add_argument("--tasks", nargs="+", help="tasks: lags, recall, markov")
    h.add_argument("--markdown", metavar="FILE", type=output_file, help="also write the Markdown table to FILE "
                   "(only between the heads-table markers when FILE has them)")
    h.add_argument("--section", metavar="NAME", help="with --markdown: fill the "
                   "heads-table:NAME markers instead of the unnamed ones")
    h.add_argument("--from-results", metavar="JSON", type=readable_file, help="do not train: render the table, "
                   "plot and Markdown from this results.json")
    h.set_defaults(func=run)


def check(args: argparse.Namespace):
    """Refuse a bad command before training: ``(config, None)`` to train, or ``(None,
    results)`` loaded from ``--from-results``."""
    from mha.experiments import heads, report
    from mha.experiments.tasks import TASKS

    check_editable_text("--markdown", args.markdown)
    check_outputs("--out", args.out, ("results.json", "table.md", "heads.png", "curves.png"))
    if args.section is not None and args.markdown is None:
        raise UsageError("--section needs --markdown FILE (the file holding its markers)")
    if args.section is not None:
        begin, end = report.markers(args.section)
        text = args.markdown.read_text(encoding="utf-8") if args.markdown.is_file() else ""
        if begin not in text or end not in text:
            raise UsageError(f"--section {args.section!r}: --markdown {str(args.markdown)!r} "
                             f"has no {begin} ... {end} markers")
    require("matplotlib")  # the plots are outputs of every run: fail before training
    if args.from_results is not None:
        given = [f"--{k.replace('_', '-')}" for k in TRAINING if getattr(args, k) not in
                 (None, False)]
        if given:
            raise UsageError(f"--from-results trains nothing: drop {', '.join(given)}")
        try:
            return None, report.load(args.from_results)
        except ValueError as e:
            raise UsageError(f"--from-results {str(args.from_results)!r}: "
                             f"{json_problem(e)}") from None
    for task in args.tasks or ():
        if task not in TASKS:
            raise UsageError(f"--tasks: unknown task {task!r}; choose from {', '.join(TASKS)}")
    name = "tiny" if args.tiny else "quick" if args.quick else "full"
    cfg = heads.preset(name, seeds=args.seeds, steps=args.steps, d_model=args.d_model,
                       n_layers=args.layers, heads=tuple(args.heads) if args.heads else None,
                       tasks=tuple(args.tasks) if args.tasks else None)
    bad = [h for h in cfg.head_counts() if cfg.d_model % h]
    if bad:
        where = "--d-model" if args.d_model else f"the {name} preset's d_model"
        raise UsageError(f"--heads must divide {where} ({cfg.d_model}), got "
                         f"{', '.join(map(str, bad))}")
    try:
        cfg.validate()
    except heads.ConfigError as e:
        if e.field == "layer_steps":  # --seeds 1000000000 would never end
            raise UsageError(f"the sweep would train {cfg.layer_steps():,} layer-steps "
                             f"({cfg.size_text()}), at most {heads.MAX_LAYER_STEPS:,}: lower "
                             f"--seeds, --steps, --layers, --heads or --tasks") from None
        option = _OPTIONS.get(e.field)
        raise UsageError(f"{option} {e.rest}" if option else f"the {name} preset's {e}") from None
    # Lower bound: each block's attention projections (4 d_model^2 weights), held with their
    # gradient and AdamW's two moments, in fp32.
    check_fits(4 * 4 * cfg.n_layers * 4 * cfg.d_model ** 2,
               f"training d_model={cfg.d_model} with {cfg.n_layers} layers")
    return cfg, None


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

    cfg, results = check(args)
    con = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if results is None:
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
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        report.write_markdown(results, args.markdown, section=args.section)
    report.plot(results, out / "heads.png")
    report.plot_curves(results, out / "curves.png")
    written = [] if args.from_results else [out / "results.json"]
    written += [out / "table.md", out / "heads.png", out / "curves.png"]
    con.print("wrote " + ", ".join(map(str, written)))
    return 0

