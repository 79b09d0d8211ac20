"""Strategies: one per file, each a `contract.Strategy`; `registry` lists them and resolves policies."""

from tpweave.ops.strategies import ce_overlap, sequential, symm_mem_allreduce, symm_mem_fused, triton_ar_norm
from tpweave.ops.strategies.contract import KINDS, Strategy, chosen_name, format_policy, parse_policy
from tpweave.ops.strategies.registry import STRATEGIES, check_policy, has_own, resolve

__all__ = [
    "KINDS",
    "STRATEGIES",
    "Strategy",
    "ce_overlap",
    "check_policy",
    "chosen_name",
    "format_policy",
    "has_own",
    "parse_policy",
    "resolve",
    "sequential",
    "symm_mem_allreduce",
    "symm_mem_fused",
    "triton_ar_norm",
]
