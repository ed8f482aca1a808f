"""The benchmark plot: every implementation's speed relative to the fastest peer, per case.

One panel per suite; in each, one group of bars per case and one bar per implementation,
its height ``fastest peer's time / its time`` on a log scale, with a line at 1.0: a bar above
the line is faster than every other library measured in the same run, a bar below is slower.
A *peer* is another library's implementation (not mha's, not a memory-read probe); a case
with no measured peer has nothing to compare with and is left out (the panel says how many).
The number above each group is mha's own ratio (``mha auto``, the module or the cache loop).
Colours are fixed per implementation across panels: blues and greens are mha's, the others
the peers'. The title names the CPU (:func:`mha.bench.cpu.describe`), the time and the load.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from mha.bench import cpu
from mha.bench.core import Row
from mha.bench.report import by_suite, is_peer, mha_row, rows_from_run

# tab20c: 0-3 blues, 8-11 greens (mha); 4-7 oranges, 12-15 purples, 16-19 greys (peers).
_MHA_COLORS = (0, 1, 2, 3, 8, 9, 10, 11)
_PEER_COLORS = (4, 5, 6, 7, 12, 13, 14, 15, 16, 17, 18, 19)


def speedups(rows: list[Row]) -> tuple[Row | None, OrderedDict]:
    """The fastest peer of one case's rows and ``{impl: fastest peer's time / impl's time}``
    for every measured implementation but the memory-read probes (empty without a peer)."""
    best = min((r for r in rows if is_peer(r)), key=lambda r: r.seconds, default=None)
    out: OrderedDict = OrderedDict()
    if best is not None:
        for r in rows:
            if r.ok and not r.impl.startswith("read "):
                out[r.impl] = best.seconds / r.seconds
    return best, out


def _colors(impls: list[str]) -> dict:
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab20c")
    mine = [i for i in impls if i.startswith("mha")]
    peers = [i for i in impls if not i.startswith("mha")]
    colors = {name: cmap(_MHA_COLORS[j % len(_MHA_COLORS)]) for j, name in enumerate(mine)}
    colors.update({name: cmap(_PEER_COLORS[j % len(_PEER_COLORS)])
                   for j, name in enumerate(peers)})
    return colors


def plot(run: dict, path: Path) -> Path:
    """Draw the run (see the module docstring) into ``path`` (PNG); ValueError when no case
    has both a peer and a measured implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    panels: OrderedDict = OrderedDict()  # suite -> (cases {case: (speedups, mha impl)}, left out)
    for suite, cases in by_suite(rows_from_run(run)).items():
        got, left_out = OrderedDict(), 0
        for case, rs in cases.items():
            best, ratios = speedups(rs)
            if best is None:
                left_out += 1
                continue
            mine = mha_row(rs)
            got[case] = (ratios, mine.impl if mine is not None and mine.impl in ratios else None)
        if got:
            panels[suite] = (got, left_out)
    if not panels:
        raise ValueError("nothing to plot: no case has a measured peer to compare with")

    impls = list(OrderedDict.fromkeys(i for got, _ in panels.values()
                                      for ratios, _ in got.values() for i in ratios))
    colors = _colors(impls)
    widest = max(sum(len(r) for r, _ in got.values()) for got, _ in panels.values())
    height = 5.5 * len(panels) + 1.0
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(min(30.0, max(12.0, 0.07 * widest + 4)), height))
    for ax, (suite, (got, left_out)) in zip(axes[:, 0], panels.items(), strict=True):
        labelled: set[str] = set()
        lo, hi = 0.5, 2.0  # at least 0.5 .. 2 around the line, so small differences stay small
        for i, (ratios, mine) in enumerate(got.values()):
            width = 0.84 / max(4, len(ratios))
            for j, (impl, ratio) in enumerate(ratios.items()):
                x = i - width * len(ratios) / 2 + (j + 0.5) * width
                ax.bar(x, ratio, width, bottom=None, color=colors[impl],
                       edgecolor="black" if impl == mine else "none", linewidth=0.6,
                       label=None if impl in labelled else impl)
                labelled.add(impl)
                lo, hi = min(lo, ratio), max(hi, ratio)
            if mine is not None:
                ax.annotate(f"{ratios[mine]:.2f}", (i, max(ratios.values())),
                            xytext=(0, 3), textcoords="offset points", ha="center",
                            fontsize=7, fontweight="bold")
        ax.axhline(1.0, color="black", lw=1.4, label="fastest peer = 1")
        ax.set_yscale("log")
        ax.set_ylim(lo / 1.6, hi * 1.8)
        ticks = [t for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)
                 if lo / 1.6 <= t <= hi * 1.8]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xticks(range(len(got)))
        ax.set_xticklabels(list(got), rotation=30, ha="right", fontsize=8)
        ax.set_xlim(-0.6, len(got) - 0.4)
        ax.set_ylabel("× fastest peer (> 1: faster)")
        note = f"; {left_out} case(s) without a measured peer left out" if left_out else ""
        ax.set_title(f"suite {suite} — bold number: mha's ratio{note}; missing bar = skipped",
                     fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    meta = run["meta"]
    fig.suptitle(f"mha bench — speed relative to the fastest peer of each case\n"
                 f"{cpu.describe(cpu.of_run(run))}\nrun of {str(meta.get('started', '?')).split(' ')[0]}, "
                 f"{meta.get('threads', '?')} threads, load {meta.get('load_start', '?')} → "
                 f"{meta.get('load_end', '?')}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / height))  # room for the three-line title
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
