"""PNG figures of :class:`mha.viz.attention_maps.AttentionMaps` (matplotlib, no display needed).

Shape legend: L layers, h heads, T tokens; ``maps.weights`` is ``(L, h, T, T)`` (rows are
queries, columns the keys they attend to).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mha.viz.attention_maps import AttentionMaps, head_entropy, mean_distance


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def attention_grid(maps: AttentionMaps, path: str | Path, *, dpi: int = 110) -> Path:
    """A layers x heads grid of heatmaps; tokens label the first column (queries, rows) and the
    last row (keys, columns) — every token, or for long texts every k-th one with its index. Every cell uses one colour scale, 0 to 1 on a square-root scale
    (the colour bar is labelled with the weights themselves)."""
    plt = _pyplot()
    L, h, T, _ = maps.weights.shape
    cell = float(np.clip(0.16 * T, 1.25, 2.6))  # inches per heatmap, grows with the token count
    if L * h > 100:  # a deep model (SmolLM2: 30 x 9): smaller cells keep the PNG in bounds
        cell = min(cell, 1.6)
    from matplotlib.colors import PowerNorm

    fig, axes = plt.subplots(L, h, figsize=(cell * h + 1.6, cell * L + 1.4), squeeze=False)
    every = max(1, int(np.ceil(T * 7 / (cell * 72))))  # a label at least 7 points apart
    ticks = np.arange(0, T, every)
    labels = [maps.tokens[i] if every == 1 else f"{i} {maps.tokens[i]}" for i in ticks]
    fs = float(np.clip(0.85 * cell * 72 / len(ticks), 3.0, 7.0))  # points per label
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)  # square-root scale: small weights show
    image = None
    for layer in range(L):
        for head in range(h):
            ax = axes[layer, head]
            image = ax.imshow(maps.weights[layer, head], cmap="viridis", norm=norm,
                              interpolation="nearest")  # (T, T): rows queries, columns keys
            ax.tick_params(length=0, pad=1)
            ax.set_xticks(ticks if layer == L - 1 else [])
            ax.set_yticks(ticks if head == 0 else [])
            if layer == 0:
                ax.set_title(f"head {head}", fontsize=8)
            if head == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=8)
                ax.set_yticklabels(labels, fontsize=fs)
            if layer == L - 1:
                ax.set_xticklabels(labels, fontsize=fs, rotation=90)
    title = fig.suptitle(f"{maps.model}: attention weights per layer and head "
                         f"(rows: query token, columns: key token; run through attn_implementation="
                         f"{maps.attn_implementation!r})", fontsize=10)
    top, bottom = 0.93, 0.1
    if L * h > 100:  # a tall figure: margins in inches, not in fractions of its height
        height = cell * L + 1.4
        top, bottom = 1 - 0.6 / height, 0.9 / height
        title.set_y(1 - 0.2 / height)
    fig.subplots_adjust(left=0.07, right=0.93, bottom=bottom, top=top, wspace=0.08, hspace=0.08)
    cax = fig.add_axes([0.945, 0.25, 0.008, 0.5])
    fig.colorbar(image, cax=cax).set_label("weight", fontsize=8)
    return _save(fig, path, dpi)


def head_stats(maps: AttentionMaps, path: str | Path, *, dpi: int = 130) -> Path:
    """Two layers x heads tables as heatmaps: mean attention entropy (bits) and mean attention
    distance (tokens), each cell annotated with its value."""
    plt = _pyplot()
    L, h, T, _ = maps.weights.shape
    stats = ((head_entropy(maps.weights), "mean entropy of a query's attention (bits)",
              f"0 = one token, {np.log2(T):.2f} = uniform over T={T}", "magma"),
             (mean_distance(maps.weights), "mean attention distance (tokens)",
              "sum_j a_ij |i - j|, averaged over queries i", "cividis"))
    fig, axes = plt.subplots(1, 2, figsize=(2 * (0.55 * h + 1.8), 0.55 * L + 1.9))
    for ax, (values, title, subtitle, cmap) in zip(axes, stats, strict=True):
        im = ax.imshow(values, cmap=cmap, aspect="auto")  # (L, h)
        mid = (values.min() + values.max()) / 2
        for layer in range(L):
            for head in range(h):
                v = values[layer, head]
                ax.text(head, layer, f"{v:.1f}", ha="center", va="center", fontsize=7,
                        color="black" if v > mid else "white")
        ax.set_xticks(np.arange(h))
        ax.set_yticks(np.arange(L))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(f"{title}\n{subtitle}", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
    fig.suptitle(f"{maps.model}, per-head statistics for {T} tokens: {maps.text!r}", fontsize=10)
    fig.tight_layout()
    return _save(fig, path, dpi)


def _save(fig, path, dpi) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
