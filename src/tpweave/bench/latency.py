"""`tpweave bench latency`: the whole model, every arm in one run, under CUDA graphs.

Prefill (time to first token): B fresh prompts of L tokens in one step (packed, causal attention,
logits of the last rows). Decode (time per output token): one new token for each of B sequences
with C tokens of context in the paged KV cache. The arms of bench/arms.py (compute_only: the same shards
without communication, sharing the weights). At every M, the CUDA graph each arm was timed with is
profiled and its communication kernels checked against what its sites chose (bench/kernels.py).
"""

from __future__ import annotations

from typing import Any

import torch

from tpweave.bench.arms import ARMS, arm_rows, compile_arms, compile_reports, fallbacks, prove_arms
from tpweave.bench.layer import BenchSettings, _progress
from tpweave.bench.timing import many_compiles, time_arms
from tpweave.models import build_model, resolve_config
from tpweave.models.config import DTYPES
from tpweave.models.llama import LlamaForCausalLM
from tpweave.runtime.context import TPContext


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
    """Build the model (num_layers, when given, overrides its layer count) and compile it once per timed arm
    (bench/arms.py): (config, TP model, {arm: compiled model})."""
    overrides = {"num_layers": num_layers} if num_layers else {}
    cfg = resolve_config(model, **overrides)
    tp_model = build_model(cfg, tp=ctx, dtype=dtype)
    compiled = compile_arms(
        tp_model, no_comm_twin(tp_model, ctx), device=ctx.device, dtype=dtype, table=table, arms=arms
    )
    return cfg, tp_model, compiled


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
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """prefill: (batch, input length) pairs; decode: (batch, context length) pairs. (rows, record) as in
    bench_layers: the record has each repetition's arm order, the kernels seen per (phase, M, arm), the
    proof problems, and every arm's compile report and fallbacks."""
    dtype = DTYPES[dtype_name]
    record: dict[str, Any] = {"orders": {}, "kernels": {}, "problems": []}
    rows: list[dict[str, Any]] = []
    with many_compiles():
        cfg, tp_model, compiled = build_arms(ctx, model, dtype=dtype, num_layers=num_layers, table=table)
        probe = torch.empty(0, device=ctx.device, dtype=dtype)
        dev = ctx.device

        def measure(what: str, m: int, key: dict, args: tuple) -> None:
            fns = {a: (lambda f=f: f(*args)) for a, f in compiled.items()}
            timings = time_arms(fns, group=ctx.group, reps=settings.reps, warmup=settings.warmup,
                                inner=settings.inner, seed=m, captures=settings.captures)  # fmt: skip
            record["orders"][f"{what} {key}"] = timings.orders
            for row in arm_rows(timings, key={"what": what, **key, "tokens": m}):
                row["variant"] = compiled[row.get("chosen") or row["arm"]].variant_for(m)
                rows.append(row)
            if settings.verify:
                record["kernels"][f"{what} {key}"], found = prove_arms(
                    compiled, timings.runners, m, probe=probe, world_size=ctx.world_size
                )
                record["problems"] += [f"{what} {key}: {p}" for p in found]

        # Largest M first: symmetric-memory workspaces are sized once, before any capture.
        for batch, length in _progress(sorted(prefill, key=lambda p: -p[0] * p[1]), ctx, "prefill"):
            m = batch * length
            ids = torch.randint(cfg.vocab_size, (m,), device=dev, generator=torch.Generator(device=dev).manual_seed(m))
            positions = torch.arange(length, device=dev).repeat(batch)
            cu = torch.arange(0, m + 1, length, dtype=torch.int32, device=dev)
            measure(
                "prefill",
                m,
                {"batch": batch, "input_len": length},
                (ids, positions, cu, None, None, None, 0, cu[1:] - 1),
            )
        if decode:
            num_slots = max(b * -(-c // block_size) * block_size for b, c in decode) + block_size
            tp_model.set_kv_cache(num_slots)
            for v in compiled.values():  # the compute-only twin shares the cache too
                if v.module is not tp_model:
                    v.module.set_kv_cache(None, share_with=tp_model)
        for batch, context in _progress(sorted(decode, key=lambda p: (-p[0], -p[1])), ctx, "decode"):
            width = -(-context // block_size)
            tables = torch.arange(batch * width, dtype=torch.int32, device=dev).view(batch, width)
            gen = torch.Generator(device=dev).manual_seed(batch)
            ids = torch.randint(cfg.vocab_size, (batch,), device=dev, generator=gen)
            positions = torch.full((batch,), context - 1, device=dev)
            slots = tables[:, (context - 1) // block_size].long() * block_size + (context - 1) % block_size
            cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
            ctx_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
            args = (ids, positions, cu, slots, ctx_lens, tables, block_size, torch.arange(batch, device=dev))
            measure("decode", batch, {"batch": batch, "context": context}, args)
    record["compile_reports"] = compile_reports(compiled)
    record["fallbacks"] = fallbacks(compiled)
    return rows, record
