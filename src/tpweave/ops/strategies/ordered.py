"""Ordered: every cross-rank sum in one fixed order (a tree over the ranks), in fp32 (ops/collectives.py
`ordered_sum`), and every matmul through the batch-invariant tiles (ops/invariant.py). What
CompileOptions(invariant="batch") routes every site to at TP >= 2: a row's sum then does not depend on how many rows
the collective carries, whichever graph (plain or SP) runs. Runs everywhere (CPU/gloo included); the gather moves
world_size times a reduce-scatter's bytes."""

from __future__ import annotations

import torch

from tpweave.ops import invariant
from tpweave.ops.collectives import ordered_all_reduce
from tpweave.ops.strategies.contract import Strategy


def ag_mm(x_local, weights, biases, token_sizes, group_name, world_size, *, need_gathered=True):
    """AgMm: all_gather_tokens (no sum: exact), then one invariant matmul per weight."""
    a = torch.ops.tpweave.all_gather_tokens(x_local, token_sizes, group_name, world_size)
    a2 = a.reshape(-1, a.shape[-1])
    outs = [invariant.invariant_mm(a2, w) if b is None else invariant.invariant_addmm(b, a2, w)
            for w, b in zip(weights, biases)]  # fmt: skip
    return [a, *outs]


def mm_rs(a, weight, group_name, world_size):
    """MmRs: the invariant matmul, then the ordered reduce-scatter."""
    product = invariant.invariant_mm(a, weight)
    return torch.ops.tpweave.ordered_reduce_scatter_tokens(product, 1, group_name, world_size)


def all_reduce(x, group_name, world_size):
    """AllReduce in one fixed order (ordered_sum)."""
    return ordered_all_reduce(x, group_name, world_size)


ORDERED = Strategy(name="ordered", ag_mm=ag_mm, mm_rs=mm_rs, all_reduce=all_reduce, candidate=False)
