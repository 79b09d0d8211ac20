"""Token-dimension collectives for any number of tokens N (N % TP != 0 and N < TP included).

Layout: the leading `num_token_dims` dims of an activation are tokens (N = their product), the rest
are features F. A token shard holds max(ceil(N / TP), 2) rows of shape F (`shard_rows`); the last
shards carry zero padding.

`all_reduce` is a plain functional collective (Dynamo and our passes see `_c10d_functional.all_reduce`);
the token ops are custom ops with fake implementations so N stays symbolic under torch.compile.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_funcol = torch.ops._c10d_functional


def all_reduce(x: Tensor, group_name: str | None) -> Tensor:
    """Sum of x over the ranks of `group_name` (x itself when None: no communication)."""
    if group_name is None:
        return x
    return _funcol.wait_tensor(_funcol.all_reduce(x, "sum", group_name))


def all_gather_dim0(x: Tensor, world_size: int, group_name: str | None) -> Tensor:
    """x (N, *F) of every rank concatenated in rank order: (world_size * N, *F); x itself when group_name is
    None."""
    if group_name is None:
        return x
    return _funcol.wait_tensor(_funcol.all_gather_into_tensor(x.contiguous(), world_size, group_name))


MIN_SHARD_ROWS = 2


def shard_rows(num_tokens, world_size: int):
    """Rows per token shard: ceil(N / TP), but never fewer than 2 (zero padding). Works on ints and SymInts.

    The floor of 2 keeps one graph for every N >= 2: with ceil(N/TP) alone a shard has one row for
    N = 2..TP, so under torch.compile that size may be 1 and every meta function or Inductor lowering
    that asks "is this dim 1?" (broadcasting, contiguity) guards on it, e.g. `((1 + s0) // 2) != 1`: a
    recompile at N = 2 (TP = 2). Max(ceil(N/TP), 2) is >= 2 by its value range: nothing guards."""
    return torch.sym_max((num_tokens + world_size - 1) // world_size, MIN_SHARD_ROWS)


def _flatten_padded(x: Tensor, num_token_dims: int, world_size: int) -> Tensor:
    """(*tokens, *F) -> (shard_rows(N) * TP, *F), zero rows appended."""
    x = x.reshape(-1, *x.shape[num_token_dims:])
    pad = shard_rows(x.shape[0], world_size) * world_size - x.shape[0]
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return x.contiguous()


@torch.library.custom_op("tpweave::reduce_scatter_tokens", mutates_args=())
def reduce_scatter_tokens(x: Tensor, num_token_dims: int, group_name: str, world_size: int) -> Tensor:
    """Sum over ranks, keep this rank's rows: (*tokens, *F) -> (shard_rows(N), *F)."""
    flat = _flatten_padded(x, num_token_dims, world_size)
    return _funcol.wait_tensor(_funcol.reduce_scatter_tensor(flat, "sum", world_size, group_name))


@reduce_scatter_tokens.register_fake
def _(x, num_token_dims, group_name, world_size):
    num_tokens = math.prod(x.shape[:num_token_dims])
    return x.new_empty(shard_rows(num_tokens, world_size), *x.shape[num_token_dims:])


def tree_sum(parts: list[Tensor]) -> Tensor:
    """The parts summed pairwise, neighbours first: ((p0 + p1) + (p2 + p3)) + ... A fixed order that does not depend on
    the tensors' sizes, and for a power-of-two count the same binary tree whether its leaves are summed on one rank
    or its subtrees on several (ops/invariant.py: the "tp" level)."""
    while len(parts) > 1:
        pairs = [parts[i] + parts[i + 1] for i in range(0, len(parts) - 1, 2)]
        parts = pairs + ([parts[-1]] if len(parts) % 2 else [])
    return parts[0]


def ordered_sum(parts: Tensor, dtype: torch.dtype) -> Tensor:
    """parts (W, ...) summed in fp32 in one fixed order (tree_sum over the ranks), in `dtype`. The order does not depend
    on the tensor's size or on where a row sits in it (a backend's ring or tree reduction does)."""
    return tree_sum([parts[r].float() for r in range(parts.shape[0])]).to(dtype)


@torch.library.custom_op("tpweave::ordered_sum_gathered", mutates_args=())
def ordered_sum_gathered(gathered: Tensor, world_size: int, dtype: torch.dtype | None = None) -> Tensor:
    """The ranks' parts of an all-gather along dim 0 ((W * N, *F), rank r's rows r * N onwards) summed as ordered_sum
    sums them: (N, *F) in `dtype` (None: the parts'), each element the bits ordered_all_reduce gives it."""
    parts = gathered.view(world_size, gathered.shape[0] // world_size, *gathered.shape[1:])
    summed = ordered_sum(parts, dtype or gathered.dtype)
    # one rank: ordered_sum may hand back a view of its input
    return summed.clone() if summed.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr() else summed


@ordered_sum_gathered.register_fake
def _(gathered, world_size, dtype=None):
    return gathered.new_empty(gathered.shape[0] // world_size, *gathered.shape[1:], dtype=dtype or gathered.dtype)


def ordered_all_reduce(x: Tensor, group_name: str, world_size: int) -> Tensor:
    """Sum of x over the ranks, every element in one fixed order (ordered_sum): the ranks' x all-gathered, then
    summed."""
    parts = all_gather_dim0(x.contiguous().reshape(1, -1), world_size, group_name)
    return ordered_sum(parts, x.dtype).reshape(x.shape)


@torch.library.custom_op("tpweave::ordered_reduce_scatter_tokens", mutates_args=())
def ordered_reduce_scatter_tokens(x: Tensor, num_token_dims: int, group_name: str, world_size: int) -> Tensor:
    """reduce_scatter_tokens with every row summed in one fixed order (ordered_sum): the same bits for a row whatever
    the number of rows, and the same as ordered_all_reduce gives it."""
    flat = _flatten_padded(x, num_token_dims, world_size)
    parts = all_gather_dim0(flat[None], world_size, group_name)  # (W, W * rows, *F)
    rows = flat.shape[0] // world_size
    rank = torch.distributed.get_rank(torch.distributed.distributed_c10d._resolve_process_group(group_name))
    return ordered_sum(parts[:, rank * rows : (rank + 1) * rows], x.dtype)


@ordered_reduce_scatter_tokens.register_fake
def _(x, num_token_dims, group_name, world_size):
    num_tokens = math.prod(x.shape[:num_token_dims])
    return x.new_empty(shard_rows(num_tokens, world_size), *x.shape[num_token_dims:])


@torch.library.custom_op("tpweave::all_gather_tokens", mutates_args=())
def all_gather_tokens(x: Tensor, token_sizes: list[int], group_name: str, world_size: int) -> Tensor:
    """Inverse of the token sharding: (shard_rows(N), *F) -> (*token_sizes, *F), padding dropped."""
    # 1-byte floats (FP8) travel as bytes: not every backend (gloo) knows the float8 dtypes.
    wire = x.contiguous().view(torch.uint8) if x.dtype.itemsize == 1 and x.dtype.is_floating_point else x.contiguous()
    full = _funcol.wait_tensor(_funcol.all_gather_into_tensor(wire, world_size, group_name)).view(x.dtype)
    return full[: math.prod(token_sizes)].reshape(*token_sizes, *x.shape[1:])


@all_gather_tokens.register_fake
def _(x, token_sizes, group_name, world_size):
    return x.new_empty(*token_sizes, *x.shape[1:])


@torch.library.custom_op("tpweave::shard_tokens", mutates_args=())
def shard_tokens(x: Tensor, num_token_dims: int, rank: int, world_size: int) -> Tensor:
    """This rank's token shard of a replicated tensor, no communication: (*tokens, *F) -> (shard_rows(N), *F)."""
    flat = _flatten_padded(x, num_token_dims, world_size)
    rows = flat.shape[0] // world_size
    return flat[rank * rows : (rank + 1) * rows].clone()


@shard_tokens.register_fake
def _(x, num_token_dims, rank, world_size):
    num_tokens = math.prod(x.shape[:num_token_dims])
    return x.new_empty(shard_rows(num_tokens, world_size), *x.shape[num_token_dims:])
