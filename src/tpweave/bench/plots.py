"""PNG plots of benchmark results (needs matplotlib: `pip install tpweave[plots]`)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any


def plot_layer_speedup(rows: list[dict[str, Any]], title: str, path: str | Path) -> Path | None:
    """Speedup over baseline TP against M, one line per arm (layer rows)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        if r.get("what") == "layer":
            series[r["arm"]].append((r["tokens"], r["vs_baseline"]))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, points in series.items():
        points.sort()
        ax.plot([m for m, _ in points], [s for _, s in points], marker="o", label=arm, linestyle="--" if arm == "compute_only" else "-")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per step (M)")
    ax.set_ylabel("speedup over baseline TP (per layer)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
