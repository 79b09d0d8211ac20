"""The strategy-dispatched ops, one node each in a compiled graph: all-gather + matmul(s)
(`tpweave::ag_mm`, FP8 `ag_scaled_mm`), matmul + reduce-scatter (`mm_rs`, `scaled_mm_rs`), the
plain graph's all-reduce (`all_reduce`) and the fused forms ending in residual add + RMSNorm
(`all_reduce_rms_norm`, `mm_rs_rms_norm`), and that fused all-reduce + norm split in two for the token-split
graph: started on a side stream on a few SMs (`all_reduce_rms_norm_start`), waited for where its result is read
(`all_reduce_rms_norm_wait`).

Each carries a `policy` string baked into the graph; at run time the strategy is picked from it and
the token count M (ops/strategies/registry.py `resolve`). On CPU, and wherever a strategy cannot run,
that is `sequential`, so CI runs the same graph.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tpweave.ops import rms_norm
from tpweave.ops.collectives import shard_rows
from tpweave.ops.strategies import resolve, triton_ar_norm


@torch.library.custom_op("tpweave::ag_mm", mutates_args=())
def ag_mm(
    x_local: Tensor,
    weights: list[Tensor],
    biases: list[Tensor | None],
    token_sizes: list[int],
    group_name: str,
    world_size: int,
    policy: str,
    need_gathered: bool = True,
) -> list[Tensor]:
    """[A, A2 @ W_0 (+ b_0), ...]: A (*token_sizes, K) gathered from the (shard_rows(N), K) shards, A2 = A
    as (N, K). need_gathered=False: nothing reads A (the async-TP pass knows), so a strategy may leave
    it unwritten."""
    impl = resolve(policy, math.prod(token_sizes), x_local, "ag_mm")
    return impl(x_local, weights, biases, token_sizes, group_name, world_size, need_gathered=need_gathered)


@ag_mm.register_fake
def _(x_local, weights, biases, token_sizes, group_name, world_size, policy, need_gathered=True):
    num_tokens = math.prod(token_sizes)
    a = x_local.new_empty(*token_sizes, *x_local.shape[1:])
    return [a] + [x_local.new_empty(num_tokens, w.shape[1]) for w in weights]


@torch.library.custom_op("tpweave::mm_rs", mutates_args=())
def mm_rs(a: Tensor, weight: Tensor, group_name: str, world_size: int, policy: str) -> Tensor:
    """reduce_scatter_tokens(a @ weight): (N, K) x (K, H) -> this rank's (shard_rows(N), H) rows of the sum."""
    return resolve(policy, a.shape[0], a, "mm_rs")(a, weight, group_name, world_size)


@mm_rs.register_fake
def _(a, weight, group_name, world_size, policy):
    return a.new_empty(shard_rows(a.shape[0], world_size), weight.shape[1])


@torch.library.custom_op("tpweave::mm_rs_rms_norm", mutates_args=())
def mm_rs_rms_norm(
    a: Tensor,
    weight: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor,
    eps: float,
    weight_in_fp32: bool,
    group_name: str,
    world_size: int,
    policy: str,
) -> tuple[Tensor, Tensor]:
    """(rms_norm(h) * norm_weight, h) with h = mm_rs(a, weight) + residual: this rank's (shard_rows(N), H) rows."""
    impl = resolve(policy, a.shape[0], a, "mm_rs_rms_norm")
    return impl(a, weight, residual, norm_weight, eps, weight_in_fp32, group_name, world_size)


@mm_rs_rms_norm.register_fake
def _(a, weight, residual, norm_weight, eps, weight_in_fp32, group_name, world_size, policy):
    h = a.new_empty(shard_rows(a.shape[0], world_size), weight.shape[1])
    return h.new_empty(h.shape, dtype=rms_norm.out_dtype(h, norm_weight, weight_in_fp32)), h


@torch.library.custom_op("tpweave::ag_scaled_mm", mutates_args=())
def ag_scaled_mm(
    x_local: Tensor,
    x_scale_local: Tensor,
    weights: list[Tensor],
    w_scales: list[Tensor],
    biases: list[Tensor | None],
    token_sizes: list[int],
    group_name: str,
    world_size: int,
    out_dtype: torch.dtype,
    policy: str,
    need_gathered: bool = True,
) -> list[Tensor]:
    """FP8 ag_mm: [A, A_scale, scaled_mm(A, W_0, A_scale, w_scale_0) (+ b_0), ...] with A (N, K) FP8 and
    A_scale (N, 1) gathered from the token shards; W_i (N_i, K) FP8, w_scale_i (N_i,). need_gathered as in ag_mm."""
    impl = resolve(policy, math.prod(token_sizes), x_local, "ag_scaled_mm")
    args = (x_local, x_scale_local, weights, w_scales, biases, token_sizes, group_name, world_size, out_dtype)
    return impl(*args, need_gathered=need_gathered)


@ag_scaled_mm.register_fake
def _(
    x_local,
    x_scale_local,
    weights,
    w_scales,
    biases,
    token_sizes,
    group_name,
    world_size,
    out_dtype,
    policy,
    need_gathered=True,
):
    num_tokens = math.prod(token_sizes)
    a = x_local.new_empty(*token_sizes, *x_local.shape[1:])
    a_scale = x_scale_local.new_empty(*token_sizes, *x_scale_local.shape[1:])
    return [a, a_scale] + [x_local.new_empty(num_tokens, w.shape[0], dtype=out_dtype) for w in weights]


@torch.library.custom_op("tpweave::scaled_mm_rs", mutates_args=())
def scaled_mm_rs(
    a: Tensor,
    a_scale: Tensor,
    weight: Tensor,
    w_scale: Tensor,
    group_name: str,
    world_size: int,
    out_dtype: torch.dtype,
    policy: str,
) -> Tensor:
    """reduce_scatter_tokens(scaled_mm(a, weight, a_scale, w_scale)): this rank's (shard_rows(N), N_out) rows
    of the sum."""
    impl = resolve(policy, a.shape[0], a, "scaled_mm_rs")
    return impl(a, a_scale, weight, w_scale, group_name, world_size, out_dtype)


@scaled_mm_rs.register_fake
def _(a, a_scale, weight, w_scale, group_name, world_size, out_dtype, policy):
    return a.new_empty(shard_rows(a.shape[0], world_size), weight.shape[0], dtype=out_dtype)


@torch.library.custom_op("tpweave::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group_name: str, world_size: int, policy: str) -> Tensor:
    """Sum over ranks (the plain TP graph's collective), strategy picked from M = rows of x."""
    return resolve(policy, math.prod(x.shape[:-1]), x, "all_reduce")(x, group_name, world_size)


@all_reduce.register_fake
def _(x, group_name, world_size, policy):
    return torch.empty_like(x)


@torch.library.custom_op("tpweave::all_reduce_rms_norm", mutates_args=())
def all_reduce_rms_norm(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
    weight_in_fp32: bool,
    group_name: str,
    world_size: int,
    policy: str,
) -> tuple[Tensor, Tensor]:
    """(rms_norm(h) * weight, h) with h = all_reduce(x) + residual (ops/rms_norm.py has the rounding rules)."""
    impl = resolve(policy, math.prod(x.shape[:-1]), x, "all_reduce_rms_norm")
    return impl(x, residual, weight, eps, weight_in_fp32, group_name, world_size)


@all_reduce_rms_norm.register_fake
def _(x, residual, weight, eps, weight_in_fp32, group_name, world_size, policy):
    return x.new_empty(x.shape, dtype=rms_norm.out_dtype(x, weight, weight_in_fp32)), torch.empty_like(x)


@torch.library.custom_op("tpweave::all_reduce_rms_norm_start", mutates_args=())
def all_reduce_rms_norm_start(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
    weight_in_fp32: bool,
    group_name: str,
    world_size: int,
    num_sms: int,
) -> tuple[Tensor, Tensor]:
    """`all_reduce_rms_norm` started on a side stream on at most num_sms SMs (the token-split graph: the other
    subset's matmuls run beside it); (y, h) are valid only after `all_reduce_rms_norm_wait` of the same inputs.
    Where the fused kernel cannot run (CPU, a group size not a power of 2) it is the composed form, in place."""
    return triton_ar_norm.start_on_side_stream(
        x, residual, weight, eps, weight_in_fp32, group_name, world_size, num_programs=num_sms
    )


@all_reduce_rms_norm_start.register_fake
def _(x, residual, weight, eps, weight_in_fp32, group_name, world_size, num_sms):
    return x.new_empty(x.shape, dtype=rms_norm.out_dtype(x, weight, weight_in_fp32)), torch.empty_like(x)


# y and h count as written here: whatever reads them comes after it in the compiled program; x and residual
# are arguments so that their memory outlives the side-stream kernel that reads them.
@torch.library.custom_op("tpweave::all_reduce_rms_norm_wait", mutates_args=("y", "h"))
def all_reduce_rms_norm_wait(
    y: Tensor, h: Tensor, x: Tensor, residual: Tensor | None, weight: Tensor, group_name: str, world_size: int
) -> None:
    """The current stream waits for the `all_reduce_rms_norm_start` of (x, residual, weight) that writes y, h."""
    triton_ar_norm.wait_side_stream(y, x, residual, weight, group_name, world_size)
