"""`tpweave calibrate`: time every strategy for every site shape on a grid of M, keep the winners,
then time the SP graph and the token-split graph against the plain graph per layer to find where each
starts to pay."""

from __future__ import annotations

from collections import defaultdict

from tpweave.bench.layer import BenchSettings, bench_layers, bench_ops
from tpweave.models.config import DTYPES, get_preset
from tpweave.runtime.context import TPContext
from tpweave.tuning.policy_fit import policy_from_op_rows, sp_min_from_layer_rows, token_split_min_from_layer_rows
from tpweave.tuning.table import StrategyTable, table_key

DEFAULT_GRID = [1, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384]


def calibrate(
    ctx: TPContext, model: str, *, dtype_name: str, grid: list[int], settings: BenchSettings, num_layers: int
) -> StrategyTable:
    """Time every strategy per site shape and per M of `grid`, then the SP graph against the plain graph per
    layer; the table of per-site winners, with sp_min_tokens and the raw measurements filled in."""
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
    layer_rows, _ = bench_layers(
        ctx,
        model,
        grid,
        dtype_name=dtype_name,
        num_layers=num_layers,
        settings=settings,
        table=table,
        arms=("plain_best", "auto", "token_split", "compute_only"),
    )
    table.sp_min_tokens = sp_min_from_layer_rows(layer_rows)
    table.token_split_min_tokens = token_split_min_from_layer_rows(layer_rows, table.sp_min_tokens)
    table.measurements = {"ops": op_rows, "layers": layer_rows}
    return table
