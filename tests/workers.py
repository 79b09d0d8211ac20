"""Functions the tests run on every rank through tpweave.launch (importable by spawned workers)."""
from __future__ import annotations

import os
import time

import torch

from tpweave.models import build_model
from tpweave.models.inputs import random_batch, split_tokens
from tpweave.ops import collectives

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def batch_for(num_tokens: int, *, vocab_size: int, device, seed: int = 0):
    return random_batch(split_tokens(num_tokens, 3), vocab_size=vocab_size, seed=seed + num_tokens, device=device)


@torch.no_grad()
def eager_logits(ctx, source, token_counts, dtype_names=("float32",), seed=0, **overrides):
    """{(dtype, M): logits on CPU} for the model built on this rank."""
    out = {}
    for name in dtype_names:
        model = build_model(source, tp=ctx, dtype=DTYPES[name], seed=seed, **overrides)
        for m in token_counts:
            batch = batch_for(m, vocab_size=model.config.vocab_size, device=ctx.device)
            out[(name, m)] = model(*batch.args()).float().cpu()
    return out


def state_dict_cpu(ctx, source, seed=0, dtype_name="float32"):
    model = build_model(source, tp=ctx, dtype=DTYPES[dtype_name], seed=seed)
    return {k: v.cpu() for k, v in model.state_dict().items()}


def build_with_rank_seed(ctx):
    build_model("tiny", tp=ctx, dtype=torch.float32, seed=ctx.rank)


def raise_on_rank(ctx, bad_rank):
    if ctx.rank == bad_rank:
        raise ValueError(f"boom from rank {ctx.rank}")
    torch.distributed.barrier()
    return ctx.rank


def die_on_rank(ctx, bad_rank):
    if ctx.rank == bad_rank:
        os._exit(3)
    torch.distributed.barrier()
    return ctx.rank


def hang_on_rank(ctx, bad_rank):
    if ctx.rank == bad_rank:
        time.sleep(3600)
    return ctx.rank


def token_collectives(ctx, token_counts, feature_shape):
    """For each M: (reduce_scatter then all_gather) and all_reduce of the same rank-dependent input."""
    out = {}
    for m in token_counts:
        x = torch.arange(m * torch.Size(feature_shape).numel(), dtype=torch.float32).reshape(m, *feature_shape)
        x = (x + 1000 * ctx.rank).to(ctx.device)
        reduced = collectives.all_reduce(x.clone(), ctx.group_name)
        shard = torch.ops.tpweave.reduce_scatter_tokens(x, 1, ctx.group_name, ctx.world_size)
        gathered = torch.ops.tpweave.all_gather_tokens(shard, [m], ctx.group_name, ctx.world_size)
        local = torch.ops.tpweave.shard_tokens(reduced, 1, ctx.rank, ctx.world_size)
        out[m] = (reduced.cpu(), gathered.cpu(), shard.cpu(), local.cpu())
    return out


def compiled_collectives_recompiles(ctx, token_counts):
    """Compile RS -> token-wise op -> AG with M dynamic; return (#compilations, max error) over all M."""
    num_compiles = 0

    def backend(gm, example_inputs):
        nonlocal num_compiles
        num_compiles += 1
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    def f(x):
        shard = torch.ops.tpweave.reduce_scatter_tokens(x, 1, ctx.group_name, ctx.world_size)
        y = torch.nn.functional.silu(shard) * 2
        return torch.ops.tpweave.all_gather_tokens(y, [x.shape[0]], ctx.group_name, ctx.world_size)

    from tpweave.compiler.dynamic import mark_tokens_dynamic, token_dynamic_config

    cf = torch.compile(f, backend=backend)
    worst = 0.0
    with token_dynamic_config():
        for m in token_counts:
            x = torch.randn(m, 8, generator=torch.Generator().manual_seed(m)).to(ctx.device) + ctx.rank
            mark_tokens_dynamic([x])
            ref = torch.nn.functional.silu(collectives.all_reduce(x.clone(), ctx.group_name)) * 2
            worst = max(worst, float((cf(x) - ref).abs().max()))
    return num_compiles, worst
