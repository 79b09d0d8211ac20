"""From calibration measurements to a strategy table's entries: the winning strategy per site and M
range, and the M from which the SP graph beats the plain graph (bench/calibrate.py measures)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

NEVER = 1 << 31
# A strategy must beat `sequential` by this much to be chosen: noise must not flip a site.
MIN_GAIN = 0.02


def policy_from_op_rows(rows: list[dict[str, Any]]) -> str:
    """'winner@M' steps over the grid, e.g. 'sequential@0,symm_mem_fused@1024'. A strategy wins an M only
    where it beats `sequential` by MIN_GAIN and, when the rows carry intervals (vs_sequential with a
    verdict), significantly: noise must not flip a site."""
    by_m: dict[int, dict[str, float]] = defaultdict(dict)
    significant: dict[int, set[str]] = defaultdict(set)
    for r in rows:
        if r["arm"] != "compute_only":
            by_m[r["tokens"]][r["arm"]] = r["ms"]
            verdict = r.get("vs_sequential")
            if not isinstance(verdict, dict) or verdict.get("verdict") == "faster":
                significant[r["tokens"]].add(r["arm"])
    steps: list[tuple[int, str]] = []
    for i, m in enumerate(sorted(by_m)):
        times = {arm: t for arm, t in by_m[m].items() if arm == "sequential" or arm in significant[m]}
        best = min(times, key=times.get)
        if best != "sequential" and times[best] > times["sequential"] * (1 - MIN_GAIN):
            best = "sequential"
        if not steps or steps[-1][1] != best:
            steps.append((0 if i == 0 else m, best))
    return ",".join(f"{name}@{m}" for m, name in steps) or "sequential"


def sp_min_from_layer_rows(rows: list[dict[str, Any]]) -> int:
    """Smallest grid M from which the SP graph ("auto" with SP forced) is no slower than the best plain
    graph ("plain_best") at every larger M."""
    by_m: dict[int, dict[str, float]] = defaultdict(dict)
    for r in rows:
        by_m[r["tokens"]][r["arm"]] = r["ms_per_layer"]
    sp_min = NEVER
    for m in sorted(by_m, reverse=True):
        if by_m[m]["auto"] <= by_m[m]["plain_best"]:
            sp_min = m
        else:
            break
    return sp_min
