"""From calibration measurements to a strategy table's entries: the winning strategy per site and M
range, the M from which the SP graph beats the plain graph, and the M range where the token-split graph
does (bench/calibrate.py measures)."""

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


def token_split_min_from_layer_rows(rows: list[dict[str, Any]], sp_min: int) -> int | None:
    """Smallest grid M below sp_min from which the token-split graph ("token_split") beats the best plain
    graph significantly (its vs_plain_best interval above 1.0; by MIN_GAIN on the medians without one) at
    every larger grid M below sp_min; None where it never does."""
    wins: dict[int, bool] = {}
    for r in rows:
        if r["arm"] != "token_split" or r["tokens"] >= sp_min:
            continue
        ratio = r.get("vs_plain_best")
        if isinstance(ratio, dict):
            wins[r["tokens"]] = ratio["lo"] > 1.0 and ratio["ratio"] >= 1 + MIN_GAIN
        else:
            best = next(b["ms_per_layer"] for b in rows if b["tokens"] == r["tokens"] and b["arm"] == "plain_best")
            wins[r["tokens"]] = r["ms_per_layer"] <= best * (1 - MIN_GAIN)
    split_min = None
    for m in sorted(wins, reverse=True):
        if not wins[m]:
            break
        split_min = m
    return split_min if split_min is None else max(split_min, 4)
