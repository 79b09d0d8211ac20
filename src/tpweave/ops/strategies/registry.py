"""Every strategy tpweave has, by name, and the one rule that turns (policy, M, input, kind) into the
callable that runs.

The rule (`resolve`): the policy names a strategy for M; if that strategy serves the kind (itself, or
by composition for the fused norm kinds) and is available for the input (device, dtype, build), it
runs; otherwise `sequential` does, with a warning on CUDA, where a silent fallback would fake a
benchmark arm. A new strategy is a module in this package whose Strategy is listed in STRATEGIES.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import MappingProxyType

from torch import Tensor

from tpweave.ops.strategies import ce_overlap, ordered, sequential, symm_mem_allreduce, symm_mem_fused, triton_ar_norm
from tpweave.ops.strategies.contract import Strategy, chosen_name, parse_policy

STRATEGIES: MappingProxyType[str, Strategy] = MappingProxyType(
    {
        s.name: s
        for s in (
            sequential.SEQUENTIAL,
            symm_mem_allreduce.ONE_SHOT,
            symm_mem_allreduce.TWO_SHOT,
            symm_mem_fused.SYMM_MEM_FUSED,
            triton_ar_norm.TRITON_AR_NORM,
            triton_ar_norm.TRITON_AR_NORM_LL,
            ce_overlap.CE_OVERLAP,
            ce_overlap.CE_OVERLAP_2S,
            ordered.ORDERED,
            ordered.ORDERED_TP,
        )
    }
)


def check_policy(policy: str) -> str:
    """`policy` if it parses and names only known strategies; else ValueError naming the unknown one."""
    for _, name in parse_policy(policy):
        if name not in STRATEGIES:
            raise ValueError(f"unknown strategy {name!r} in policy {policy!r}: one of {', '.join(STRATEGIES)}")
    return policy


def resolve(policy: str, num_tokens: int, x: Tensor, kind: str) -> Callable:
    """The implementation of `kind` that runs for M = num_tokens under `policy` (see the module doc)."""
    name = chosen_name(policy, num_tokens)
    strategy = STRATEGIES.get(name)
    impl = strategy.implementation(kind) if strategy is not None and strategy.available(x) else None
    if impl is None:
        if x.is_cuda:
            warnings.warn(f"tpweave: strategy {name!r} cannot run {kind} here: using 'sequential'", stacklevel=2)
        impl = sequential.SEQUENTIAL.implementation(kind)
    return impl


def has_own(policy: str, kind: str) -> bool:
    """Whether some strategy of `policy` implements `kind` itself (not by composition)."""
    return any(getattr(STRATEGIES.get(name), kind, None) is not None for _, name in parse_policy(policy))
