"""The comparison's figure: perplexity against evaluation length, one curve per scheme."""

from __future__ import annotations

import math


def plot(rows, seq_len, factors, path, quick: bool = False) -> None:
    """Perplexity against evaluation length, log-scale y so that every curve stays readable; a scheme that
    cannot run at a length (a learned table's end) is marked there with an x on the top edge; legend outside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    lengths = [seq_len * f for f in factors]
    marked = False
    colors = plt.get_cmap("tab10").colors
    for index, row in enumerate(rows):
        # more schemes than colours: the eleventh and later are dashed, so that no two curves look alike
        style = dict(color=colors[index % len(colors)], linestyle="-" if index < len(colors) else "--")
        values = [row[f"ppl_{f}x"] for f in factors]
        finite = [(n, v, row.get(f"ppl_{f}x_std", 0.0)) for n, f, v in zip(lengths, factors, values) if math.isfinite(v)]
        line = None
        if finite:  # error bars: one standard deviation over the seeds
            n, v, std = zip(*finite)
            line = ax.errorbar(n, v, yerr=std, marker="o", capsize=3, label=row["scheme"], **style).lines[0]
        for n, v in zip(lengths, values):
            if not math.isfinite(v):
                color = line.get_color() if line is not None else None
                ax.plot([n], [1.0], marker="x", markersize=9, color=color, clip_on=False,
                        transform=ax.get_xaxis_transform(), label=None if marked else "cannot run (past its table)")
                marked = True
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    from matplotlib.ticker import LogFormatter

    for axis_format in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis_format(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))  # plain numbers on a log axis
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity (held-out text, log scale)")
    title = f"Length extrapolation, trained at L={seq_len}"
    ax.set_title(title + (" — quick run, not comparable" if quick else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
