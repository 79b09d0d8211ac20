"""The strategy-dispatched ops: all-gather + matmul(s), matmul + reduce-scatter and all-reduce, one
node each in the graph.

Which implementation (strategy) runs is decided at run time from the token count M and a `policy`
string baked into the graph: "name" or "name@m0,name2@m1,..." meaning name2 from M >= m1 on, etc.
The strategies live in ops/strategies/, one per file, and register themselves in STRATEGIES.
On CPU (and for any strategy that cannot run) the op falls back to `sequential`, so CI runs the same graph.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from tpweave.ops.collectives import shard_rows


@dataclass(frozen=True)
class Strategy:
    name: str
    ag_mm: Callable[..., list[Tensor]] | None = None
    mm_rs: Callable[..., Tensor] | None = None
    all_reduce: Callable[..., Tensor] | None = None
    ag_scaled_mm: Callable[..., list[Tensor]] | None = None  # FP8: gather (x, x_scale), scaled matmul(s)
    scaled_mm_rs: Callable[..., Tensor] | None = None
    # (x, residual, weight, eps, weight_in_fp32, group, world) -> (normed, h); a strategy without it
    # serves tpweave::all_reduce_rms_norm through its all_reduce, then the add + norm kernel
    all_reduce_rms_norm: Callable[..., tuple[Tensor, Tensor]] | None = None
    # (a, weight, residual, norm_weight, eps, weight_in_fp32, group, world) -> (normed, h): mm_rs whose final
    # reduction runs in the add + norm kernel; a strategy without it serves tpweave::mm_rs_rms_norm through
    # its mm_rs, then the add + norm kernel
    mm_rs_rms_norm: Callable[..., tuple[Tensor, Tensor]] | None = None
    available: Callable[[Tensor], bool] = lambda x: True
    # False: keeps symmetric-memory state that Inductor's CUDA graph trees would allocate inside their
    # pool on the first (recording) call and then reject ("tensors in the cudagraph pool not tracked").
    cudagraph_trees_safe: bool = True


STRATEGIES: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    STRATEGIES[strategy.name] = strategy
    return strategy


@functools.lru_cache(maxsize=256)
def parse_policy(policy: str) -> tuple[tuple[int, str], ...]:
    """'sequential' -> ((0, 'sequential'),); 'a@0,b@2048' -> ((0,'a'), (2048,'b')), sorted by M."""
    steps = []
    for part in policy.split(","):
        name, _, start = part.strip().partition("@")
        steps.append((int(start or 0), name))
    return tuple(sorted(steps))


def without_unsafe_under_cudagraph_trees(policy: str) -> str:
    """The policy with every strategy that cannot run inside Inductor's CUDA graph trees replaced by
    'sequential' (tpweave's own capture, bench/timing.py, warms up outside the pool and can run them)."""
    steps = [
        (m, n if STRATEGIES.get(n, STRATEGIES["sequential"]).cudagraph_trees_safe else "sequential")
        for m, n in parse_policy(policy)
    ]
    return ",".join(f"{n}@{m}" for m, n in steps)


def chosen_name(policy: str, num_tokens: int) -> str:
    """The strategy name the policy gives M = num_tokens."""
    chosen = "sequential"
    for start, name in parse_policy(policy):
        if num_tokens >= start:
            chosen = name
    return chosen


def pick(policy: str, num_tokens: int, x: Tensor, kind: str) -> Strategy:
    chosen = chosen_name(policy, num_tokens)
    strategy = STRATEGIES.get(chosen)
    if strategy is None or getattr(strategy, kind) is None or not strategy.available(x):
        if x.is_cuda:
            _warn_fallback(chosen, kind)  # on GPU a silent fallback would fake a benchmark arm
        strategy = STRATEGIES["sequential"]
    return strategy


@functools.cache
def _warn_fallback(name: str, kind: str) -> None:
    from tpweave.compiler.log import logger

    logger.warning("strategy %r cannot run %s here: using 'sequential'", name, kind)


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
    """[A, A2 @ W_0 (+ b_0), ...]: A (*token_sizes, K) gathered from the (ceil(N/TP), K) shards, A2 = A as (N, K).
    need_gathered=False: nothing reads A (the async-TP pass knows), so a strategy may leave it unwritten."""
    num_tokens = math.prod(token_sizes)
    strategy = pick(policy, num_tokens, x_local, "ag_mm")
    return strategy.ag_mm(x_local, weights, biases, token_sizes, group_name, world_size, need_gathered=need_gathered)


@ag_mm.register_fake
def _(x_local, weights, biases, token_sizes, group_name, world_size, policy, need_gathered=True):
    num_tokens = math.prod(token_sizes)
    a = x_local.new_empty(*token_sizes, *x_local.shape[1:])
    return [a] + [x_local.new_empty(num_tokens, w.shape[1]) for w in weights]


@torch.library.custom_op("tpweave::mm_rs", mutates_args=())
def mm_rs(a: Tensor, weight: Tensor, group_name: str, world_size: int, policy: str) -> Tensor:
    """reduce_scatter_tokens(a @ weight): (N, K) x (K, H) -> this rank's (ceil(N/TP), H) rows of the sum."""
    strategy = pick(policy, a.shape[0], a, "mm_rs")
    return strategy.mm_rs(a, weight, group_name, world_size)


@mm_rs.register_fake
def _(a, weight, group_name, world_size, policy):
    return a.new_empty(shard_rows(a.shape[0], world_size), weight.shape[1])


def compose_mm_rs_rms_norm(
    name: str,
    a: Tensor,
    weight: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor,
    eps: float,
    weight_in_fp32: bool,
    group_name: str,
    world_size: int,
) -> tuple[Tensor, Tensor]:
    """Strategy `name`'s matmul + reduce-scatter, then one residual-add + RMSNorm kernel."""
    from tpweave.ops.rms_norm import add_rms_norm

    summed = pick(name, a.shape[0], a, "mm_rs").mm_rs(a, weight, group_name, world_size)
    return add_rms_norm(summed, residual, norm_weight, eps=eps, weight_in_fp32=weight_in_fp32)


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
    """(rms_norm(h) * norm_weight, h) with h = mm_rs(a, weight) + residual: this rank's (ceil(N/TP), H) rows."""
    chosen = chosen_name(policy, a.shape[0])
    strategy = STRATEGIES.get(chosen)
    if strategy is not None and strategy.mm_rs_rms_norm is not None and strategy.available(a):
        return strategy.mm_rs_rms_norm(a, weight, residual, norm_weight, eps, weight_in_fp32, group_name, world_size)
    return compose_mm_rs_rms_norm(chosen, a, weight, residual, norm_weight, eps, weight_in_fp32, group_name, world_size)


@mm_rs_rms_norm.register_fake
def _(a, weight, residual, norm_weight, eps, weight_in_fp32, group_name, world_size, policy):
    from tpweave.ops.rms_norm import out_dtype

    h = a.new_empty(shard_rows(a.shape[0], world_size), weight.shape[1])
    return h.new_empty(h.shape, dtype=out_dtype(h, norm_weight, weight_in_fp32)), h


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
    strategy = pick(policy, math.prod(token_sizes), x_local, "ag_scaled_mm")
    return strategy.ag_scaled_mm(
        x_local,
        x_scale_local,
        weights,
        w_scales,
        biases,
        token_sizes,
        group_name,
        world_size,
        out_dtype,
        need_gathered=need_gathered,
    )


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
    return [
        x_local.new_empty(*token_sizes, *x_local.shape[1:]),
        x_scale_local.new_empty(*token_sizes, *x_scale_local.shape[1:]),
    ] + [x_local.new_empty(num_tokens, w.shape[0], dtype=out_dtype) for w in weights]


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
    """reduce_scatter_tokens(scaled_mm(a, weight, a_scale, w_scale)): this rank's (ceil(N/TP), N_out) "
    "rows of the sum."""
    strategy = pick(policy, a.shape[0], a, "scaled_mm_rs")
    return strategy.scaled_mm_rs(a, a_scale, weight, w_scale, group_name, world_size, out_dtype)


@scaled_mm_rs.register_fake
def _(a, a_scale, weight, w_scale, group_name, world_size, out_dtype, policy):
    return a.new_empty(shard_rows(a.shape[0], world_size), weight.shape[0], dtype=out_dtype)


@torch.library.custom_op("tpweave::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group_name: str, world_size: int, policy: str) -> Tensor:
    """Sum over ranks (the plain TP graph's collective), strategy picked from M = rows of x."""
    num_tokens = math.prod(x.shape[:-1])
    return pick(policy, num_tokens, x, "all_reduce").all_reduce(x, group_name, world_size)


@all_reduce.register_fake
def _(x, group_name, world_size, policy):
    return torch.empty_like(x)


def compose_all_reduce_rms_norm(
    name: str,
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
    weight_in_fp32: bool,
    group_name: str,
    world_size: int,
) -> tuple[Tensor, Tensor]:
    """Strategy `name`'s all-reduce, then one residual-add + RMSNorm kernel."""
    from tpweave.ops.rms_norm import add_rms_norm

    summed = pick(name, 0, x, "all_reduce").all_reduce(x, group_name, world_size)
    return add_rms_norm(summed, residual, weight, eps=eps, weight_in_fp32=weight_in_fp32)


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
    chosen = chosen_name(policy, math.prod(x.shape[:-1]))
    strategy = STRATEGIES.get(chosen)
    if strategy is not None and strategy.all_reduce_rms_norm is not None and strategy.available(x):
        return strategy.all_reduce_rms_norm(x, residual, weight, eps, weight_in_fp32, group_name, world_size)
    return compose_all_reduce_rms_norm(chosen, x, residual, weight, eps, weight_in_fp32, group_name, world_size)


@all_reduce_rms_norm.register_fake
def _(x, residual, weight, eps, weight_in_fp32, group_name, world_size, policy):
    from tpweave.ops.rms_norm import out_dtype

    return x.new_empty(x.shape, dtype=out_dtype(x, weight, weight_in_fp32)), torch.empty_like(x)


from tpweave.ops.strategies import ce_overlap as _ce_overlap  # noqa: E402,F401
from tpweave.ops.strategies import sequential as _sequential  # noqa: E402,F401  (registers)
from tpweave.ops.strategies import symm_mem_allreduce as _symm_mem_allreduce  # noqa: E402,F401
from tpweave.ops.strategies import symm_mem_fused as _symm_mem_fused  # noqa: E402,F401
from tpweave.ops.strategies import triton_ar_norm as _triton_ar_norm  # noqa: E402,F401
