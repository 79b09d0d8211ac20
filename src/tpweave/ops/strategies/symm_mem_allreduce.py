"""All-reduce over symmetric memory with NVLink peer loads (torch's one-shot / two-shot kernels).

CUDA only, bf16/fp32, no multicast. The input is staged into a symmetric buffer first; one-shot
reads every peer's whole buffer (latency-bound sizes), two-shot reduces 1/TP per rank and gathers.
"""

from __future__ import annotations

import torch

from tpweave.ops import symm_buffers
from tpweave.ops.strategies.contract import Strategy


def _available(x: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float32)
        and symm_buffers.has_symm_mem_ops("one_shot_all_reduce", "two_shot_all_reduce_out")
    )


def one_shot(x, group_name, world_size):
    """AllReduce: x staged into the group's symmetric buffer, then torch's one-shot kernel (every rank reads
    every peer's whole buffer)."""
    return torch.ops.symm_mem.one_shot_all_reduce(symm_buffers.staged(x.contiguous(), group_name), "sum", group_name)


def two_shot(x, group_name, world_size):
    """AllReduce: x staged into the group's symmetric buffer, then torch's two-shot kernel (each rank reduces
    1/TP, then gathers); for a single rank, a copy of x."""
    if world_size == 1:  # torch's two-shot kernel refuses one rank; the sum is the input
        return x.clone()
    staged = symm_buffers.staged(x.contiguous(), group_name)
    return torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", group_name, torch.empty_like(staged))


ONE_SHOT = Strategy(name="symm_mem_one_shot", all_reduce=one_shot, available=_available)
TWO_SHOT = Strategy(name="symm_mem_two_shot", all_reduce=two_shot, available=_available)
