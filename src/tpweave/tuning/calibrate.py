"""`tpweave calibrate`: time every strategy for every site shape on a grid of M, keep the winners,
then time the SP graph against the plain graph per layer to find where SP starts to pay."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from tpweave.bench.layer import BenchSettings, bench_layers, bench_ops
from tpweave.models.config import DTYPES, get_preset
from tpweave.runtime.context import TPContext
from tpweave.tuning.table import StrategyTable, table_key

DEFAULT_GRID = [1, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384]
NEVER = 1 << 31
# A strategy must beat `sequential` by this much to be chosen: noise must not flip a site.
MIN_GAIN = 0.02


def policy_from_op_rows(rows: list[dict[str, Any]]) -> str:
    """'winner@M' steps over the grid, e.g. 'sequential@0,symm_mem_fused@1024'."""
    by_m: dict[int, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r["arm"] != "compute_only":
            by_m[r["tokens"]][r["arm"]] = r["ms"]
    steps: list[tuple[int, str]] = []
    for i, m in enumerate(sorted(by_m)):
        times = by_m[m]
        best = min(times, key=times.get)
        if best != "sequential" and times[best] > times["sequential"] * (1 - MIN_GAIN):
            best = "sequential"
        if not steps or steps[-1][1] != best:
            steps.append((0 if i == 0 else m, best))
    return ",".join(f"{name}@{m}" for m, name in steps) or "sequential"


def sp_min_from_layer_rows(rows: list[dict[str, Any]]) -> int:
    """Smallest grid M from which the SP graph is no slower than the plain graph at every larger M."""
    by_m: dict[int, dict[str, float]] = defaultdict(dict)
    for r in rows:
        by_m[r["tokens"]][r["arm"]] = r["ms_per_layer"]
    sp_min = NEVER
    for m in sorted(by_m, reverse=True):
        if by_m[m]["auto"] <= by_m[m]["baseline"]:
            sp_min = m
        else:
            break
    return sp_min


def calibrate(
    ctx: TPContext, model: str, *, dtype_name: str, grid: list[int], settings: BenchSettings, num_layers: int
) -> StrategyTable:
    cfg = get_preset(model)
    dtype = DTYPES[dtype_name]
    op_rows = bench_ops(ctx, model, grid, dtype_name=dtype_name, settings=settings)
    by_site: dict[str, list] = defaultdict(list)
    for r in op_rows:
        by_site[r["site"]].append(r)
    table = StrategyTable(
        key=table_key(cfg, tp=ctx.world_size, dtype=dtype),
        policies={s: policy_from_op_rows(rows) for s, rows in by_site.items()},
        sp_min_tokens=0,
    )
    layer_rows = bench_layers(
        ctx,
        model,
        grid,
        dtype_name=dtype_name,
        num_layers=num_layers,
        settings=settings,
        table=table,
        arms=("baseline", "auto", "compute_only"),
    )
    table.sp_min_tokens = sp_min_from_layer_rows(layer_rows)
    table.measurements = {"ops": op_rows, "layers": layer_rows}
    return table
