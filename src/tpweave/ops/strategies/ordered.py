"""Ordered: every cross-rank sum in one fixed order (a tree over the ranks), in fp32 (ops/collectives.py
`ordered_sum`), and every matmul through the batch-invariant tiles (ops/invariant.py). What
CompileOptions(invariant="batch") routes every site to at TP >= 2: a row's sum then does not depend on how many rows
the collective carries, whichever graph (plain, token split or SP, with or without async TP) runs. `ordered_tp` is
the "tp" level's: the matmuls as tree products over K chunks, a row-parallel product's ranks exchanging their fp32
subtrees (ops/invariant.py, K_CHUNKS). Runs everywhere (CPU/gloo included); a sum's gather moves world_size times a
reduce-scatter's bytes.

Async TP keeps its overlap in both, with the bits of the unfused ops: a matmul's rows do not depend on the rows
beside them, so the product can be taken in pieces, and the piece of this rank's own rows hides the exchange of the
others':

    ag_mm:  gather = all_gather(x_local)          (in flight)      mm_rs:  others = a's other ranks' rows @ w
            own = x_local @ w                     (under it)               swap = all_to_all(others)   (in flight)
            rest = the other ranks' rows @ w                               own = a's own rows @ w       (under it)
            out = [rest before, own, rest after]                           out = ordered_sum([swap..., own in rank
                                                                                 order])
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tpweave.ops import invariant
from tpweave.ops.collectives import _flatten_padded, ordered_all_reduce, tree_sum
from tpweave.ops.strategies.contract import Strategy

_funcol = torch.ops._c10d_functional


def _product(a: Tensor, w: Tensor, b: Tensor | None, tree: bool, row_parallel_ranks: int = 0) -> Tensor:
    """a @ w (+ b): the batch level's fixed-tile product, or the "tp" level's tree product (tree); with
    row_parallel_ranks = W and tree, a row-parallel product's fp32 subtree of this rank (no bias)."""
    if tree and row_parallel_ranks:
        return invariant.tp_invariant_rank_subtree(a, w, row_parallel_ranks)
    if tree:
        return invariant.tp_invariant_mm(a, w) if b is None else invariant.tp_invariant_addmm(b, a, w)
    return invariant.invariant_mm(a, w) if b is None else invariant.invariant_addmm(b, a, w)


def _rank(group_name: str) -> int:
    return torch.distributed.get_rank(torch.distributed.distributed_c10d._resolve_process_group(group_name))


def _ag_mm(x_local, weights, biases, token_sizes, group_name, world_size, *, need_gathered=True, tree=False):
    """AgMm: this rank's shard multiplied under the all-gather, then the other ranks' rows (the module doc)."""
    rows, n = x_local.shape[0], math.prod(token_sizes)
    x_local = x_local.contiguous()
    gathering = _funcol.all_gather_into_tensor(x_local, world_size, group_name)
    own = [_product(x_local, w, b, tree) for w, b in zip(weights, biases)]
    gathered = _funcol.wait_tensor(gathering)  # (W * rows, K), the last rows zero padding
    start = _rank(group_name) * rows
    before, after = gathered[:start], gathered[start + rows : n]
    outs = []
    for w, b, mine in zip(weights, biases, own):
        pieces = [_product(x, w, b, tree) for x in (before, after) if x.shape[0]]
        outs.append(torch.cat([*pieces[: int(start > 0)], mine, *pieces[int(start > 0) :]])[:n])
    return [gathered[:n].reshape(*token_sizes, x_local.shape[1]), *outs]


def _mm_rs(a, weight, group_name, world_size, *, tree=False):
    """MmRs: the other ranks' rows multiplied and sent to them, this rank's own multiplied under the exchange, the
    ranks' parts of its rows summed in the fixed order (the module doc); the "tp" level's parts are fp32 subtrees."""
    flat = _flatten_padded(a, 1, world_size)
    rows, rank = flat.shape[0] // world_size, _rank(group_name)

    def product(x: Tensor) -> Tensor:
        return _product(x, weight, None, tree, world_size)

    if world_size == 1:
        return product(flat).to(a.dtype)
    others = [product(x) for x in (flat[: rank * rows], flat[(rank + 1) * rows :]) if x.shape[0]]
    splits = [0 if r == rank else rows for r in range(world_size)]
    swapping = _funcol.all_to_all_single(torch.cat(others), splits, splits, group_name)
    own = product(flat[rank * rows : (rank + 1) * rows])
    parts = list(_funcol.wait_tensor(swapping).split(rows))  # the other ranks' parts of this rank's rows, rank order
    parts.insert(rank, own)
    return tree_sum([p.float() for p in parts]).to(a.dtype)


def _all_reduce(x, group_name, world_size):
    """AllReduce in one fixed order (ordered_sum)."""
    return ordered_all_reduce(x, group_name, world_size)


def _ag_mm_tp(x_local, weights, biases, token_sizes, group_name, world_size, *, need_gathered=True):
    return _ag_mm(x_local, weights, biases, token_sizes, group_name, world_size, tree=True)


def _mm_rs_tp(a, weight, group_name, world_size):
    return _mm_rs(a, weight, group_name, world_size, tree=True)


ORDERED = Strategy(name="ordered", ag_mm=_ag_mm, mm_rs=_mm_rs, all_reduce=_all_reduce, candidate=False)
ORDERED_TP = Strategy(name="ordered_tp", ag_mm=_ag_mm_tp, mm_rs=_mm_rs_tp, all_reduce=_all_reduce, candidate=False)
# the strategy every site runs under at each invariant level (compiler/options.py plan)
BY_LEVEL = {"batch": ORDERED.name, "tp": ORDERED_TP.name}
