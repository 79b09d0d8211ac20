"""PNG plots of benchmark results (needs matplotlib: `pip install tpweave[plots]`)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_speedup(
    rows: list[dict[str, Any]], axes: tuple[str, str, str, str], title: str, path: str | Path
) -> Path | None:
    """One line per arm (and per series, e.g. context length or input length), y against x; a y that is
    a ratio with an interval (bench/stats.py) gets its 95% interval as error bars."""
    plt = _pyplot()
    x_key, y_key, x_label, y_label = axes
    series: dict[str, list[tuple[float, float, float, float]]] = defaultdict(list)
    for r in rows:
        y = r.get(y_key)
        if y is None or r["arm"] in ("auto_aa",):
            continue
        extra = next((f" {k}={r[k]}" for k in ("context", "input_len") if k in r and k != x_key), "")
        mid, lo, hi = (y["ratio"], y["lo"], y["hi"]) if isinstance(y, dict) else (y, y, y)
        series[f"{r['arm']}{extra}"].append((r[x_key], mid, mid - lo, min(hi, 10 * mid) - mid))
    if plt is None or not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in sorted(series.items()):
        points.sort()
        ax.errorbar(
            [p[0] for p in points],
            [p[1] for p in points],
            yerr=[[p[2] for p in points], [p[3] for p in points]],
            marker="o",
            capsize=2,
            label=label,
            linestyle="--" if label.startswith("compute_only") else "-",
        )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_serve(rows: list[dict[str, Any]], title: str, path: str | Path) -> Path | None:
    """TTFT and TPOT p50/p99 per arm, one group of bars per workload and rate."""
    plt = _pyplot()
    if plt is None or not rows:
        return None
    groups = sorted({(r["workload"], r["rate"]) for r in rows})
    arms = sorted({r["arm"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / (2 * len(arms))
    for ax, metric in zip(axes, ("ttft_ms", "tpot_ms")):
        for i, arm in enumerate(arms):
            for j, pct in enumerate(("p50", "p99")):
                vals = [
                    next(
                        (
                            r[f"{metric}_{pct}"] or 0
                            for r in rows
                            if r["arm"] == arm and (r["workload"], r["rate"]) == g
                        ),
                        0,
                    )
                    for g in groups
                ]
                offset = (2 * i + j) * width
                ax.bar([k + offset for k in range(len(groups))], vals, width, label=f"{arm} {pct}")
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(groups))])
        ax.set_xticklabels([f"{w}\n{r:g} req/s" for w, r in groups], fontsize=7)
        ax.set_ylabel(f"{metric.replace('_ms', '')} (ms)")
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_engine(rows: list[dict[str, Any]], title: str, path: str | Path) -> Path | None:
    """Per decode batch, bars of the engine's step, the graph-replayed forward and the HBM roofline (ms)."""
    plt = _pyplot()
    if plt is None or not rows:
        return None
    rows = sorted(rows, key=lambda r: r["batch"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for i, (key, label) in enumerate(
        (("step_ms", "engine step (median)"), ("forward_ms", "forward, CUDA graph"), ("roofline_ms", "HBM roofline"))
    ):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ax.bar(xs, [r.get(key) or 0 for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("ms per decode step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
