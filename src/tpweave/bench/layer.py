"""`tpweave bench layer`: per decoder layer and per overlapped op, every arm in one run.

Arms (whole layers): baseline (plain TP, NCCL all-reduce), sp_seq (SP, plain collectives),
sp_fused (SP + torch's symm-mem fused ops), auto (tpweave with the calibrated table), compute_only
(same shards, no communication: the lower bound). Per op: every registered strategy and the
compute-only matmul. Hidden fraction = (T_baseline - T) / (T_baseline - T_compute_only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tpweave import compiler
from tpweave.bench.timing import time_arms
from tpweave.compiler import PLAIN_TP
from tpweave.models import build_model
from tpweave.models.config import DTYPES, get_preset
from tpweave.ops.strategies import STRATEGIES
from tpweave.runtime.context import TPContext
from tpweave.tuning.table import SiteShape, StrategyTable, site_shapes

LAYER_ARMS = ("baseline", "sp_seq", "sp_fused", "auto", "compute_only")


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
    """Timing loop sizes: `reps` interleaved samples after `warmup` calls per arm, each sample the mean
    of `inner` back-to-back runs."""

    reps: int = 10
    warmup: int = 3
    inner: int = 5


def _layer_variants(ctx: TPContext, model: str, *, dtype: torch.dtype, num_layers: int, table: StrategyTable | None):
    cfg = get_preset(model, num_layers=num_layers)
    tp_model = build_model(cfg, tp=ctx, dtype=dtype)
    no_comm = TPContext(rank=ctx.rank, world_size=ctx.world_size, group_name=None, device=ctx.device)
    compute_model = build_model(cfg, tp=no_comm, dtype=dtype)
    stack, compute_stack = LayerStack(tp_model.model.layers), LayerStack(compute_model.model.layers)
    fused = (
        "symm_mem_fused" if STRATEGIES["symm_mem_fused"].available(torch.empty(0, device=ctx.device)) else "sequential"
    )
    if ctx.device.type == "cuda" and fused != "symm_mem_fused":
        raise RuntimeError("torch's symm_mem fused ops are not available: the sp_fused arm would not measure them")
    variants = {
        "baseline": compiler.compile(stack, options=PLAIN_TP),
        "sp_seq": compiler.compile(stack, sp=True, sp_min_tokens=0, async_tp=False),
        "sp_fused": compiler.compile(stack, sp=True, sp_min_tokens=0, ag_mm_policy=fused, mm_rs_policy=fused),
        "auto": compiler.compile(stack, sp=True, table=table),
        "compute_only": compiler.compile(compute_stack, sp=False),
    }
    return cfg, variants


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
    arms: tuple[str, ...] = LAYER_ARMS,
) -> list[dict[str, Any]]:
    """Time `num_layers` decoder layers under each arm for every M in `tokens` (one prefill sequence of M
    tokens); one row per (M, arm), with times in ms per layer, speedup and hidden fraction against baseline."""
    dtype = DTYPES[dtype_name]
    cfg, variants = _layer_variants(ctx, model, dtype=dtype, num_layers=num_layers, table=table)
    rows = []
    for m in _progress(tokens, ctx, "layer"):
        gen = torch.Generator(device=ctx.device).manual_seed(m)
        x = torch.randn(m, cfg.hidden_size, device=ctx.device, dtype=dtype, generator=gen)
        positions = torch.arange(m, device=ctx.device)
        cu = torch.tensor([0, m], dtype=torch.int32, device=ctx.device)  # one sequence: a prefill
        fns = {name: (lambda fn=variants[name]: fn(x, positions, cu)) for name in arms}
        timings = time_arms(fns, group=ctx.group, reps=settings.reps, warmup=settings.warmup, inner=settings.inner)
        base, comp = timings["baseline"].median_ms, timings["compute_only"].median_ms
        for name in arms:
            t = timings[name]
            rows.append(
                {
                    "what": "layer",
                    "tokens": m,
                    "arm": name,
                    "ms_per_layer": t.median_ms / num_layers,
                    "vs_baseline": base / t.median_ms,
                    "hidden": hidden_fraction(t.median_ms, base, comp),
                    "of_compute_only": comp / t.median_ms,
                    "spread": t.spread,
                    "peak_mem_bytes": t.peak_mem_bytes,
                    "auto_variant": variants["auto"].variant_for(m) if name == "auto" else None,
                }
            )
    return rows


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
        names = [n for n, s in STRATEGIES.items() if s.serves(site.kind) and s.available(probe)]
        w = (torch.randn(site.n, site.k, device=ctx.device, dtype=dtype) * site.k**-0.5).t()
        for m in tokens:
            rows_local = -(-m // ctx.world_size)
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
            timings = time_arms(fns, group=ctx.group, reps=settings.reps, warmup=settings.warmup, inner=settings.inner)
            seq = timings["sequential"].median_ms
            comp = timings["compute_only"].median_ms if "compute_only" in timings else seq
            for name, t in timings.items():
                rows.append(
                    {
                        "what": "op",
                        "site": site.name,
                        "tokens": m,
                        "arm": name,
                        "ms": t.median_ms,
                        "vs_sequential": seq / t.median_ms,
                        "hidden": hidden_fraction(t.median_ms, seq, comp),
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
        xq, x_scale = fp8.quantize_rows(torch.randn(-(-m // ws), site.k, device=ctx.device, dtype=dtype))
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
    if ctx.rank != 0:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, leave=False)
