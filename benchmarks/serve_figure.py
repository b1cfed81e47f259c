"""The serving benchmark's picture: TTFT distributions and throughput of every row, one PNG.

For each workload, two panels side by side: every row's TTFTs (all requests of all runs, a box of
the quartiles with whiskers at the 5th and 95th percentiles, log scale) and every row's throughput
(the median of the runs as a bar, the runs' minimum and maximum as an error bar). Rows are labelled
``system budget phase`` and coloured by system, in the table's order.

matplotlib is optional (``pip install -e '.[bench]'``): without it :func:`write_figure` writes
nothing and says so; the benchmark's table and JSON do not need it.
"""

from __future__ import annotations

import statistics
import textwrap
from pathlib import Path

from benchmarks.serve_report import WORKLOADS, Row

MISSING = "matplotlib is not installed in this interpreter (pip install -e '.[bench]'): no figure written"


def label(row: Row) -> str:
    """``tiercache third restart``; ``none cold`` for the rows without a budget."""
    parts = [row.system] + ([row.budget] if row.budget != "–" else []) + [row.phase]
    return " ".join(parts)


def write_figure(rows: list[Row], path: Path, title: str) -> str:
    """Draw ``rows`` into the PNG ``path``; returns the line to log (where it went, or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: a file only
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return MISSING
    workloads = [wl for wl in WORKLOADS if any(r.workload == wl for r in rows)]
    if not workloads:
        return "no rows: no figure written"
    systems = list(dict.fromkeys(r.system for r in rows))
    cmap = plt.get_cmap("tab10")
    colour = {s: cmap(i % 10) for i, s in enumerate(systems)}
    height = max(3.0, 0.32 * max(sum(r.workload == wl for r in rows) for wl in workloads) + 1.2)
    fig, axes = plt.subplots(
        len(workloads), 2, figsize=(13, height * len(workloads)), squeeze=False, layout="constrained"
    )
    for (ttft_ax, tput_ax), wl in zip(axes, workloads):
        mine = [r for r in rows if r.workload == wl][::-1]  # top to bottom in the table's order
        names = [label(r) + (" (FAILED)" if r.failed else "") for r in mine]
        ttfts = [[t * 1e3 for s in r.samples for t in s["ttfts_s"]] or [float("nan")] for r in mine]
        box = ttft_ax.boxplot(
            ttfts, orientation="horizontal", whis=(5, 95), showfliers=False, patch_artist=True, widths=0.6
        )
        for patch, r in zip(box["boxes"], mine):
            patch.set_facecolor(colour[r.system])
            patch.set_alpha(0.6)
        ttft_ax.set_yticks(range(1, len(mine) + 1), names, fontsize=7)
        ttft_ax.set_xscale("log")
        plain = FuncFormatter(lambda v, _pos: f"{v:g}")  # 200, not 2 × 10²
        ttft_ax.xaxis.set_major_formatter(plain)
        ttft_ax.xaxis.set_minor_formatter(plain)
        ttft_ax.tick_params(axis="x", which="both", labelsize=7)
        ttft_ax.set_xlabel("TTFT ms (box: quartiles, whiskers: p5-p95; every request of every run)")
        ttft_ax.set_title(f"{wl}: time to first token")
        ttft_ax.grid(axis="x", which="both", alpha=0.3)

        per_run = [[float(s["tok_per_s"]) for s in r.samples] for r in mine]
        med = [statistics.median(v) for v in per_run]
        err = [[m - min(v) for m, v in zip(med, per_run)], [max(v) - m for m, v in zip(med, per_run)]]
        ys = list(range(1, len(mine) + 1))
        tput_ax.barh(ys, med, xerr=err, color=[colour[r.system] for r in mine], alpha=0.8, capsize=2)
        tput_ax.set_yticks(ys, names, fontsize=7)
        tput_ax.set_xlabel("total tok/s (bar: median of runs, line: min-max)")
        tput_ax.set_title(f"{wl}: throughput per system and phase")
        tput_ax.grid(axis="x", alpha=0.3)
    # The title names the whole setup: wrapped, or a wide one runs off the figure's edges.
    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote the figure {path}"
