"""The strategy contract: what a strategy provides (typed slots), and the policy strings that pick one per M.

A strategy is a set of implementations, one per op kind it serves. The dispatched ops
(ops/dispatched_ops.py) call `registry.resolve(policy, M, x, kind)`, which returns the callable for
`kind` under the strategy the policy gives M.

Policy strings: "name" or "name@m0,name2@m1,...": name2 from M >= m1 on, and so on; below the first
start, `sequential`. `parse_policy` reads them and rejects malformed ones with a ValueError.

The fused norm kinds compose: a strategy without `all_reduce_rms_norm` serves it as its
`all_reduce` followed by one residual-add + RMSNorm kernel (likewise `mm_rs_rms_norm` from `mm_rs`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from tpweave.ops import rms_norm

KINDS = ("ag_mm", "mm_rs", "all_reduce", "ag_scaled_mm", "scaled_mm_rs", "all_reduce_rms_norm", "mm_rs_rms_norm")
# kind -> the kind it is composed from when a strategy has no fused implementation of its own
COMPOSED_FROM = {"all_reduce_rms_norm": "all_reduce", "mm_rs_rms_norm": "mm_rs"}


class AgMm(Protocol):
    """All-gather the token shards, multiply: [A (*token_sizes, K), A2 @ W_0 (+ b_0), ...]."""

    def __call__(
        self,
        x_local: Tensor,
        weights: list[Tensor],
        biases: list[Tensor | None],
        token_sizes: list[int],
        group_name: str,
        world_size: int,
        *,
        need_gathered: bool = True,
    ) -> list[Tensor]:
        """x_local (shard_rows(N), K): this rank's shard, N = prod(token_sizes); W_i (K, N_i), b_i (N_i,) or None.
        With need_gathered=False nothing reads A, which may be left unwritten."""
        ...


class MmRs(Protocol):
    """(N, K) @ (K, H), reduce-scattered over tokens: this rank's (shard_rows(N), H) rows of the sum."""

    def __call__(self, a: Tensor, weight: Tensor, group_name: str, world_size: int) -> Tensor:
        """a (N, K), weight (K, H) -> (shard_rows(N), H)."""
        ...


class AllReduce(Protocol):
    """Sum over the ranks of the group."""

    def __call__(self, x: Tensor, group_name: str, world_size: int) -> Tensor:
        """x summed over the `world_size` ranks of `group_name`, in x's shape."""
        ...


class AgScaledMm(Protocol):
    """FP8 ag_mm: [A, A_scale, scaled_mm(A, W_i, A_scale, w_scale_i) (+ b_i), ...]."""

    def __call__(
        self,
        x_local: Tensor,
        x_scale_local: Tensor,
        weights: list[Tensor],
        w_scales: list[Tensor],
        biases: list[Tensor | None],
        token_sizes: list[int],
        group_name: str,
        world_size: int,
        out_dtype,
        *,
        need_gathered: bool = True,
    ) -> list[Tensor]:
        """x_local (shard_rows(N), K) FP8 and x_scale_local (shard_rows(N), 1); W_i (N_i, K) FP8, w_scale_i (N_i,);
        the matmul outputs in out_dtype. need_gathered as in AgMm."""
        ...


class ScaledMmRs(Protocol):
    """FP8 mm_rs: reduce_scatter_tokens(scaled_mm(a, weight, a_scale, w_scale))."""

    def __call__(
        self, a: Tensor, a_scale: Tensor, weight: Tensor, w_scale: Tensor, group_name: str, world_size: int, out_dtype
    ) -> Tensor:
        """a (N, K) FP8 with row scales a_scale (N, 1), weight (H, K) FP8 with w_scale (H,) -> (shard_rows(N), H)
        in out_dtype."""
        ...


class AllReduceRmsNorm(Protocol):
    """(rms_norm(h) * weight, h) with h = all_reduce(x) + residual."""

    def __call__(
        self,
        x: Tensor,
        residual: Tensor | None,
        weight: Tensor,
        eps: float,
        weight_in_fp32: bool,
        group_name: str,
        world_size: int,
    ) -> tuple[Tensor, Tensor]:
        """x (M, H) this rank's partial sum, residual (M, H) or None, weight (H,) -> y and h, both (M, H);
        weight_in_fp32 as in ops/rms_norm.py."""
        ...


class MmRsRmsNorm(Protocol):
    """(rms_norm(h) * norm_weight, h) with h = mm_rs(a, weight) + residual (this rank's rows)."""

    def __call__(
        self,
        a: Tensor,
        weight: Tensor,
        residual: Tensor | None,
        norm_weight: Tensor,
        eps: float,
        weight_in_fp32: bool,
        group_name: str,
        world_size: int,
    ) -> tuple[Tensor, Tensor]:
        """a (N, K), weight (K, H), residual (shard_rows(N), H) or None, norm_weight (H,) -> y and h, both
        (shard_rows(N), H)."""
        ...


def _always(x: Tensor) -> bool:
    return True


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """One way to run some of the op kinds. A slot left None means "not served" (for the fused norm
    kinds: served by composition, see `implementation`)."""

    name: str
    ag_mm: AgMm | None = None
    mm_rs: MmRs | None = None
    all_reduce: AllReduce | None = None
    ag_scaled_mm: AgScaledMm | None = None
    scaled_mm_rs: ScaledMmRs | None = None
    all_reduce_rms_norm: AllReduceRmsNorm | None = None
    mm_rs_rms_norm: MmRsRmsNorm | None = None
    # Whether this strategy can run on x's device, dtype and build (False: `sequential` runs instead).
    available: Callable[[Tensor], bool] = _always
    # Whether calibration times it as a candidate for speed (False: a mode chosen for what it guarantees, e.g. ordered)
    candidate: bool = True

    def implementation(self, kind: str) -> Callable | None:
        """The callable serving `kind`: the strategy's own slot, or for a fused norm kind its base op
        followed by the add + norm kernel; None when it serves neither."""
        if kind not in KINDS:
            raise ValueError(f"unknown op kind {kind!r}: one of {', '.join(KINDS)}")
        own = getattr(self, kind)
        if own is not None or kind not in COMPOSED_FROM:
            return own
        base = getattr(self, COMPOSED_FROM[kind])
        if base is None:
            return None
        compose = compose_all_reduce_rms_norm if kind == "all_reduce_rms_norm" else compose_mm_rs_rms_norm
        return functools.partial(compose, base)

    def serves(self, kind: str) -> bool:
        """Whether this strategy runs `kind` (itself or by composition)."""
        return self.implementation(kind) is not None


def compose_all_reduce_rms_norm(
    all_reduce: AllReduce,
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
    weight_in_fp32: bool,
    group_name: str,
    world_size: int,
) -> tuple[Tensor, Tensor]:
    """`all_reduce`, then one residual-add + RMSNorm kernel."""
    summed = all_reduce(x, group_name, world_size)
    return rms_norm.add_rms_norm(summed, residual, weight, eps=eps, weight_in_fp32=weight_in_fp32)


def compose_mm_rs_rms_norm(
    mm_rs: MmRs,
    a: Tensor,
    weight: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor,
    eps: float,
    weight_in_fp32: bool,
    group_name: str,
    world_size: int,
) -> tuple[Tensor, Tensor]:
    """`mm_rs`, then one residual-add + RMSNorm kernel."""
    summed = mm_rs(a, weight, group_name, world_size)
    return rms_norm.add_rms_norm(summed, residual, norm_weight, eps=eps, weight_in_fp32=weight_in_fp32)


@functools.lru_cache(maxsize=256)
def parse_policy(policy: str) -> tuple[tuple[int, str], ...]:
    """'sequential' -> ((0, 'sequential'),); 'a@0,b@2048' -> ((0, 'a'), (2048, 'b')), sorted by M.
    Raises ValueError for a malformed string (empty name, a start that is not an integer >= 0, a
    start given twice). Whether the names exist is the registry's check (`registry.check_policy`)."""
    if not isinstance(policy, str) or not policy.strip():
        raise ValueError(f"empty strategy policy {policy!r}: expected 'name' or 'name@M,name@M,...'")
    steps = []
    for part in policy.split(","):
        name, at, start = part.strip().partition("@")
        if not name or (at and not start.strip().isdigit()):
            raise ValueError(
                f"malformed strategy policy {policy!r}: {part.strip()!r} is not 'name' or 'name@M' (M >= 0)"
            )
        steps.append((int(start or 0), name.strip()))
    starts = [m for m, _ in steps]
    if len(set(starts)) != len(starts):
        raise ValueError(f"malformed strategy policy {policy!r}: a token count appears twice")
    return tuple(sorted(steps))


def format_policy(steps: tuple[tuple[int, str], ...] | list[tuple[int, str]]) -> str:
    """The policy string of (start M, name) steps: the inverse of `parse_policy`."""
    return ",".join(f"{name}@{m}" for m, name in steps)


def chosen_name(policy: str, num_tokens: int) -> str:
    """The strategy name the policy gives M = num_tokens (`sequential` below its first start)."""
    chosen = "sequential"
    for start, name in parse_policy(policy):
        if num_tokens >= start:
            chosen = name
    return chosen
