"""`tpweave bench layer`: per decoder layer and per overlapped op, every arm in one run.

Layers: the arms of bench/arms.py (plain_best and plain_nccl, sp_seq, sp_fused, auto and its A/A copy,
compute_only). Per op: every strategy that serves the site, and the compute-only matmul. Hidden
share = (T_plain_best - T) / (T_plain_best - T_compute_only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tpweave.bench.arms import ARMS, arm_rows, compile_arms, compile_reports, fallbacks, prove_arms
from tpweave.bench.stats import paired_ratio
from tpweave.bench.timing import many_compiles, time_arms
from tpweave.log import progress_bar
from tpweave.models import build_model
from tpweave.models.config import DTYPES, get_preset
from tpweave.ops.collectives import shard_rows
from tpweave.ops.strategies import STRATEGIES
from tpweave.runtime.context import TPContext
from tpweave.tuning.table import SiteShape, StrategyTable, site_shapes


class LayerStack(nn.Module):
    """Decoder layers only (no embedding / LM head): x (M, H) -> x (M, H)."""

    def __init__(self, layers: nn.ModuleList):
        super().__init__()
        self.layers = layers

    def forward(self, x_MH: torch.Tensor, positions_M: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Run every layer in turn: x (M, H), positions (M,), cu_seqlens (num_seqs + 1,) -> (M, H)."""
        for layer in self.layers:
            x_MH = layer(x_MH, positions_M, cu_seqlens)
        return x_MH


def hidden_fraction(t: float, t_baseline: float, t_compute: float) -> float | None:
    """Share of the communication time an arm taking t hides: (t_baseline - t) / (t_baseline - t_compute);
    None when compute alone is no faster than the baseline."""
    gap = t_baseline - t_compute
    return None if gap <= 0 else (t_baseline - t) / gap


@dataclass(frozen=True)
class BenchSettings:
    """Timing loop sizes: `reps` repetitions (arm order shuffled in each) after `warmup` calls per arm,
    each sample the mean of `inner` back-to-back runs; `verify`: prove every arm's kernels at every M."""

    reps: int = 100
    warmup: int = 3
    inner: int = 5
    verify: bool = True
    captures: int = 3  # CUDA graphs per arm (bench/timing.py): the intervals cover capture-to-capture variation


def _layer_arms(ctx: TPContext, model: str, *, dtype: torch.dtype, num_layers: int, table, arms: tuple[str, ...]):
    cfg = get_preset(model, num_layers=num_layers)
    tp_model = build_model(cfg, tp=ctx, dtype=dtype)
    no_comm = TPContext(rank=ctx.rank, world_size=ctx.world_size, group_name=None, device=ctx.device)
    compute_model = build_model(cfg, tp=no_comm, dtype=dtype)
    stack, compute_stack = LayerStack(tp_model.model.layers), LayerStack(compute_model.model.layers)
    compiled = compile_arms(stack, compute_stack, device=ctx.device, dtype=dtype, table=table, arms=arms)
    return cfg, compiled


@torch.no_grad()
def bench_layers(
    ctx: TPContext,
    model: str,
    tokens: list[int],
    *,
    dtype_name: str,
    num_layers: int,
    settings: BenchSettings,
    table: StrategyTable | None,
    arms: tuple[str, ...] = ARMS,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Time `num_layers` decoder layers under each arm (bench/arms.py) for every M in `tokens` (one
    prefill sequence of M tokens). (rows: one per (M, arm), ms per layer, ratios with 95% intervals,
    raw samples; record: each repetition's arm order, kernels seen, proof problems, compile reports
    and fallbacks of every arm)."""
    dtype = DTYPES[dtype_name]
    rows, record = [], {"orders": {}, "kernels": {}, "problems": []}
    with many_compiles():
        cfg, compiled = _layer_arms(ctx, model, dtype=dtype, num_layers=num_layers, table=table, arms=arms)
        probe = torch.empty(0, device=ctx.device, dtype=dtype)
        for m in _progress(tokens, ctx, "layer"):
            gen = torch.Generator(device=ctx.device).manual_seed(m)
            x = torch.randn(m, cfg.hidden_size, device=ctx.device, dtype=dtype, generator=gen)
            positions = torch.arange(m, device=ctx.device)
            cu = torch.tensor([0, m], dtype=torch.int32, device=ctx.device)  # one sequence: a prefill
            fns = {name: (lambda fn=fn: fn(x, positions, cu)) for name, fn in compiled.items()}
            timings = time_arms(fns, group=ctx.group, reps=settings.reps, warmup=settings.warmup,
                                inner=settings.inner, seed=m, captures=settings.captures)  # fmt: skip
            record["orders"][m] = timings.orders
            key = {"what": "layer", "tokens": m}
            for row in arm_rows(timings, scale=1 / num_layers, key=key):
                row["ms_per_layer"] = row["ms"]
                row["variant"] = compiled[row.get("chosen") or row["arm"]].variant_for(m)
                rows.append(row)
            if settings.verify:
                record["kernels"][m], found = prove_arms(
                    compiled, timings.runners, m, probe=probe, world_size=ctx.world_size
                )
                record["problems"] += found
    record["compile_reports"] = compile_reports(compiled)
    record["fallbacks"] = fallbacks(compiled)
    return rows, record


@torch.no_grad()
def bench_ops(
    ctx: TPContext,
    model: str,
    tokens: list[int],
    *,
    dtype_name: str,
    settings: BenchSettings,
    sites: list[SiteShape] | None = None,
) -> list[dict[str, Any]]:
    """Each overlapped op under every available strategy, and its matmul alone (compute only)."""
    dtype = DTYPES[dtype_name]
    cfg = get_preset(model)
    sites = sites or site_shapes(cfg, ctx.world_size)
    probe = torch.empty(0, device=ctx.device, dtype=dtype)
    rows = []
    for site in _progress(sites, ctx, "ops"):
        names = [n for n, s in STRATEGIES.items() if s.candidate and s.serves(site.kind) and s.available(probe)]
        w = (torch.randn(site.n, site.k, device=ctx.device, dtype=dtype) * site.k**-0.5).t()
        for m in tokens:
            rows_local = shard_rows(m, ctx.world_size)
            if site.kind == "ag_mm":
                x = torch.randn(rows_local, site.k, device=ctx.device, dtype=dtype)
                a_full = torch.randn(m, site.k, device=ctx.device, dtype=dtype)
                fns = {
                    n: (
                        lambda n=n: torch.ops.tpweave.ag_mm(
                            x, [w], [None], [m], ctx.group_name, ctx.world_size, n, False
                        )
                    )
                    for n in names
                }
            elif site.kind == "mm_rs":
                a_full = torch.randn(m, site.k, device=ctx.device, dtype=dtype)
                fns = {
                    n: (lambda n=n: torch.ops.tpweave.mm_rs(a_full, w, ctx.group_name, ctx.world_size, n))
                    for n in names
                }
            elif site.kind in ("ag_scaled_mm", "scaled_mm_rs"):
                fns, a_full = _fp8_site_arms(ctx, site, m, names, w, dtype)
            elif site.kind == "all_reduce_rms_norm":
                a_full, res = (torch.randn(m, site.k, device=ctx.device, dtype=dtype) for _ in range(2))
                norm_w = torch.rand(site.k, device=ctx.device, dtype=dtype) + 0.5
                fns = {
                    n: (
                        lambda n=n: torch.ops.tpweave.all_reduce_rms_norm(
                            a_full, res, norm_w, 1e-5, False, ctx.group_name, ctx.world_size, n
                        )
                    )
                    for n in names
                }
            else:
                a_full = torch.randn(m, site.k, device=ctx.device, dtype=dtype)
                fns = {
                    n: (lambda n=n: torch.ops.tpweave.all_reduce(a_full, ctx.group_name, ctx.world_size, n))
                    for n in names
                }
            if site.kind in ("ag_mm", "mm_rs"):  # an all-reduce has no compute to hide behind
                fns["compute_only"] = lambda: a_full @ w
            timings = time_arms(fns, group=ctx.group, reps=settings.reps, warmup=settings.warmup,
                                inner=settings.inner, seed=m, captures=settings.captures)  # fmt: skip
            seq = timings["sequential"]
            comp = timings["compute_only"].median_ms if "compute_only" in timings else seq.median_ms
            for name, t in timings.items():
                rows.append(
                    {
                        "what": "op",
                        "site": site.name,
                        "tokens": m,
                        "arm": name,
                        "ms": t.median_ms,
                        "samples_ms": t.samples_ms,
                        "vs_sequential": paired_ratio(seq.samples_ms, t.samples_ms, seed=m, groups=t.groups).to_dict(),
                        "hidden": hidden_fraction(t.median_ms, seq.median_ms, comp),
                        "spread": t.spread,
                    }
                )
    return rows


def _fp8_site_arms(ctx: TPContext, site: SiteShape, m: int, names: list[str], w_KN: torch.Tensor, dtype: torch.dtype):
    """Arms of an FP8 site (quantized operands, per-token and per-channel scales) and its compute-only matmul."""
    from tpweave.ops import fp8

    wq, w_scale = fp8.quantize_weight(w_KN.t(), per_channel=True)
    group, ws = ctx.group_name, ctx.world_size
    if site.kind == "ag_scaled_mm":
        xq, x_scale = fp8.quantize_rows(torch.randn(shard_rows(m, ws), site.k, device=ctx.device, dtype=dtype))
        fns = {
            n: (
                lambda n=n: torch.ops.tpweave.ag_scaled_mm(
                    xq, x_scale, [wq], [w_scale], [None], [m], group, ws, dtype, n, False
                )
            )
            for n in names
        }
    else:
        xq, x_scale = fp8.quantize_rows(torch.randn(m, site.k, device=ctx.device, dtype=dtype))
        fns = {
            n: (lambda n=n: torch.ops.tpweave.scaled_mm_rs(xq, x_scale, wq, w_scale, group, ws, dtype, n))
            for n in names
        }
    aq, a_scale = fp8.quantize_rows(torch.randn(m, site.k, device=ctx.device, dtype=dtype))
    fns["compute_only"] = lambda: torch.ops.tpweave.scaled_mm(aq, wq, a_scale, w_scale, None, dtype)
    return fns, aq


def _progress(items, ctx: TPContext, desc: str):
    return items if ctx.rank != 0 else progress_bar(items=items, desc=desc)
