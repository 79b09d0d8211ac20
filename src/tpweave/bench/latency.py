"""`tpweave bench latency`: the whole model, every arm in one run, under CUDA graphs.

Prefill (time to first token): B fresh prompts of L tokens in one step (packed, causal attention,
logits of the last rows). Decode (time per output token): one new token for each of B sequences
with C tokens of context in the paged KV cache. Arms as in `bench layer`: baseline (plain TP, NCCL
all-reduce), sp_seq, sp_fused, auto (tpweave with the calibrated table) and compute_only (the same
shards without communication, sharing the weights). A torch.profiler pass per arm records which
communication kernels ran and fails the run if an arm did not run what its configuration picked.
"""

from __future__ import annotations

from typing import Any

import torch

from tpweave import compiler
from tpweave.bench.kernels import check, expected_categories, profile_kernels
from tpweave.bench.layer import BenchSettings, _progress, hidden_fraction
from tpweave.bench.timing import allow_many_compiles, time_arms
from tpweave.compiler import PLAIN_TP
from tpweave.models import build_model, resolve_config
from tpweave.models.config import DTYPES
from tpweave.models.llama import LlamaForCausalLM
from tpweave.ops.strategies import STRATEGIES
from tpweave.runtime.context import TPContext

ARMS = ("baseline", "sp_seq", "sp_fused", "auto", "compute_only")


def no_comm_twin(model: LlamaForCausalLM, ctx: TPContext) -> LlamaForCausalLM:
    """The same shards without communication, sharing every weight and buffer with `model`."""
    no_comm = TPContext(rank=ctx.rank, world_size=ctx.world_size, group_name=None, device=torch.device("meta"))
    dtype = next(model.parameters()).dtype
    twin = LlamaForCausalLM(model.config, tp=no_comm, dtype=dtype)
    twin.load_state_dict(model.state_dict(), assign=True)
    src = dict(model.named_modules())
    for name, module in twin.named_modules():
        for bname, buf in list(src[name].named_buffers(recurse=False)):
            setattr(module, bname, buf)
    return twin.eval()


def build_arms(ctx: TPContext, model: str, *, dtype: torch.dtype, num_layers: int | None, table, arms=ARMS):
    """Build the model (num_layers, when given, overrides its layer count) and compile it once per arm: (config,
    TP model, {arm: compiled model}). Raises RuntimeError on CUDA when torch's symm_mem fused ops are missing."""
    overrides = {"num_layers": num_layers} if num_layers else {}
    cfg = resolve_config(model, **overrides)
    tp_model = build_model(cfg, tp=ctx, dtype=dtype)
    on_cuda = ctx.device.type == "cuda"
    fused = (
        "symm_mem_fused" if STRATEGIES["symm_mem_fused"].available(torch.empty(0, device=ctx.device)) else "sequential"
    )
    if on_cuda and fused != "symm_mem_fused":
        raise RuntimeError("torch's symm_mem fused ops are not available: the sp_fused arm would not measure them")
    make = {
        "baseline": lambda: compiler.compile(tp_model, options=PLAIN_TP),
        "sp_seq": lambda: compiler.compile(tp_model, sp=True, sp_min_tokens=0, async_tp=False, table=None),
        "sp_fused": lambda: compiler.compile(
            tp_model, sp=True, sp_min_tokens=0, ag_mm_policy=fused, mm_rs_policy=fused, table=None
        ),
        "auto": lambda: compiler.compile(tp_model, table=table),
        "compute_only": lambda: compiler.compile(no_comm_twin(tp_model, ctx), sp=False, table=None),
    }
    return cfg, tp_model, {name: make[name]() for name in arms}


def _verify(ctx, variants, fns, m: int, what: str) -> tuple[dict[str, Any], list[str]]:
    kernels, problems = {}, []
    if ctx.device.type != "cuda":
        return kernels, problems
    for arm, fn in fns.items():
        compiled = variants[arm]
        counts = profile_kernels(fn)
        kernels[arm] = counts
        need = expected_categories(arm, compiled.strategies_at(m), compiled.variant_for(m))
        problems += [
            f"{what} M={m}: {p}" for p in check(arm, counts["per_forward"], need, forbid_comm=arm == "compute_only")
        ]
    return kernels, problems


def _rows(what: str, timings, arms, base_key: dict[str, Any], variants, m: int) -> list[dict[str, Any]]:
    base = timings["baseline"].median_ms
    comp = timings["compute_only"].median_ms if "compute_only" in timings else None
    rows = []
    for arm in arms:
        t = timings[arm]
        rows.append(
            {
                "what": what,
                **base_key,
                "tokens": m,
                "arm": arm,
                "ms": t.median_ms,
                "vs_baseline": base / t.median_ms,
                "hidden": hidden_fraction(t.median_ms, base, comp) if comp is not None else None,
                "of_compute_only": comp / t.median_ms if comp is not None else None,
                "spread": t.spread,
                "peak_mem_bytes": t.peak_mem_bytes,
                "variant": variants[arm].variant_for(m),
            }
        )
    return rows


@torch.no_grad()
def bench_latency(
    ctx: TPContext,
    model: str,
    *,
    dtype_name: str,
    num_layers: int | None,
    prefill: list[tuple[int, int]],
    decode: list[tuple[int, int]],
    settings: BenchSettings,
    table,
    block_size: int = 16,
    verify: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """prefill: (batch, input length) pairs; decode: (batch, context length) pairs. Returns rows,
    kernel counts per (phase, arm) at the largest M of each phase, and verification problems."""
    dtype = DTYPES[dtype_name]
    allow_many_compiles()
    cfg, tp_model, variants = build_arms(ctx, model, dtype=dtype, num_layers=num_layers, table=table)
    arms = list(variants)
    dev = ctx.device
    rows: list[dict[str, Any]] = []
    kernels: dict[str, Any] = {}
    problems: list[str] = []
    # Largest M first: symmetric-memory workspaces are sized once, before any capture.
    for batch, length in _progress(sorted(prefill, key=lambda p: -p[0] * p[1]), ctx, "prefill"):
        m = batch * length
        ids = torch.randint(cfg.vocab_size, (m,), device=dev, generator=torch.Generator(device=dev).manual_seed(m))
        positions = torch.arange(length, device=dev).repeat(batch)
        cu = torch.arange(0, m + 1, length, dtype=torch.int32, device=dev)
        last = cu[1:] - 1
        fns = {a: (lambda f=variants[a]: f(ids, positions, cu, None, None, None, 0, last)) for a in arms}
        timings = time_arms(fns, group=ctx.group, reps=settings.reps, warmup=settings.warmup, inner=settings.inner)
        rows += _rows("prefill", timings, arms, {"batch": batch, "input_len": length}, variants, m)
        if verify and "prefill" not in kernels:
            kernels["prefill"], found = _verify(ctx, variants, fns, m, "prefill")
            problems += found
    if decode:
        num_slots = max(b * -(-c // block_size) * block_size for b, c in decode) + block_size
        tp_model.set_kv_cache(num_slots)
        for v in variants.values():  # the compute-only twin shares the cache too
            if v.module is not tp_model:
                v.module.set_kv_cache(None, share_with=tp_model)
    for batch, context in _progress(sorted(decode, key=lambda p: (-p[0], -p[1])), ctx, "decode"):
        width = -(-context // block_size)
        tables = torch.arange(batch * width, dtype=torch.int32, device=dev).view(batch, width)
        ids = torch.randint(
            cfg.vocab_size, (batch,), device=dev, generator=torch.Generator(device=dev).manual_seed(batch)
        )
        positions = torch.full((batch,), context - 1, device=dev)
        slots = tables[:, (context - 1) // block_size].long() * block_size + (context - 1) % block_size
        cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        ctx_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
        rows_b = torch.arange(batch, device=dev)
        fns = {
            a: (lambda f=variants[a]: f(ids, positions, cu, slots, ctx_lens, tables, block_size, rows_b)) for a in arms
        }
        timings = time_arms(fns, group=ctx.group, reps=settings.reps, warmup=settings.warmup, inner=settings.inner)
        rows += _rows("decode", timings, arms, {"batch": batch, "context": context}, variants, batch)
        if verify and "decode" not in kernels:
            kernels["decode"], found = _verify(ctx, variants, fns, batch, "decode")
            problems += found
    return rows, kernels, problems
