"""Sequential: the collective, then the matmul(s); all-reduce through the process group's backend
(NCCL on GPUs). Runs everywhere (CPU/gloo included): the reference."""

from __future__ import annotations

import torch

from tpweave.ops.collectives import all_reduce as funcol_all_reduce
from tpweave.ops.strategies.contract import Strategy


def ag_mm(x_local, weights, biases, token_sizes, group_name, world_size, *, need_gathered=True):
    """AgMm: all_gather_tokens, then one matmul (addmm with a bias) per weight; A is always written."""
    a = torch.ops.tpweave.all_gather_tokens(x_local, token_sizes, group_name, world_size)
    a2 = a.reshape(-1, a.shape[-1])
    outs = [a2 @ w if b is None else torch.addmm(b, a2, w) for w, b in zip(weights, biases)]
    return [a, *outs]


def mm_rs(a, weight, group_name, world_size):
    """MmRs: the whole (N, H) product, then reduce_scatter_tokens."""
    return torch.ops.tpweave.reduce_scatter_tokens(a @ weight, 1, group_name, world_size)


def ag_scaled_mm(
    x_local,
    x_scale_local,
    weights,
    w_scales,
    biases,
    token_sizes,
    group_name,
    world_size,
    out_dtype,
    *,
    need_gathered=True,
):
    """AgScaledMm: gather the FP8 rows and their scales, then one scaled matmul per weight."""
    gather = torch.ops.tpweave.all_gather_tokens
    a, a_scale = (gather(t, token_sizes, group_name, world_size) for t in (x_local, x_scale_local))
    a2, s2 = a.reshape(-1, a.shape[-1]), a_scale.reshape(-1, 1)
    outs = [torch.ops.tpweave.scaled_mm(a2, w, s2, ws, b, out_dtype) for w, ws, b in zip(weights, w_scales, biases)]
    return [a, a_scale, *outs]


def scaled_mm_rs(a, a_scale, weight, w_scale, group_name, world_size, out_dtype):
    """ScaledMmRs: the whole scaled matmul in out_dtype, then reduce_scatter_tokens."""
    y = torch.ops.tpweave.scaled_mm(a, weight, a_scale, w_scale, None, out_dtype)
    return torch.ops.tpweave.reduce_scatter_tokens(y, 1, group_name, world_size)


def all_reduce(x, group_name, world_size):
    """AllReduce through the process group's backend (a functional all-reduce)."""
    return funcol_all_reduce(x, group_name)


SEQUENTIAL = Strategy(
    name="sequential",
    ag_mm=ag_mm,
    mm_rs=mm_rs,
    all_reduce=all_reduce,
    ag_scaled_mm=ag_scaled_mm,
    scaled_mm_rs=scaled_mm_rs,
)
