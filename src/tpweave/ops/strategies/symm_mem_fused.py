"""torch's symmetric-memory fused ops (`symm_mem.fused_all_gather_matmul` / `fused_matmul_reduce_scatter`).

CUDA only. Their workspace is torch's, regrown (and the old one freed) by a call larger than any before:
each call first keeps the current workspace alive (symm_buffers.retain_torch_workspace), so a CUDA graph
captured before a larger call still replays valid memory. Shards are padded to shard_rows(N) =
max(shard_rows(N), 2) rows, so every rank's chunk has the same size, as the fused ops require; padding
rows are dropped from the outputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tpweave.ops import symm_buffers
from tpweave.ops.collectives import shard_rows
from tpweave.ops.strategies import sequential
from tpweave.ops.strategies.contract import Strategy

# cuBLASLt's FP8 matmuls reject a chunk whose row count is not a multiple of 16 (CUBLAS_STATUS_NOT_SUPPORTED,
# measured at 1 row per rank on H200): such shards take the sequential path.
FP8_ROW_ALIGN = 16


def _enable(group_name: str) -> None:
    """Before each call: torch's fused ops look the group up in symmetric memory's registry (torch 2.11 and
    2.13), and the workspace they use now stays alive should this call regrow it."""
    import torch.distributed._symmetric_memory as symm_mem

    if not symm_mem.is_symm_mem_enabled_for_group(group_name):
        symm_mem.enable_symm_mem_for_group(group_name)
    symm_buffers.retain_torch_workspace(group_name)


def _available(x: torch.Tensor) -> bool:
    return x.is_cuda and symm_buffers.has_symm_mem_ops("fused_all_gather_matmul", "fused_matmul_reduce_scatter")


def ag_mm(x_local, weights, biases, token_sizes, group_name, world_size, *, need_gathered=True):
    """AgMm by torch's fused_all_gather_matmul; the biases are added to its outputs."""
    _enable(group_name)
    num_tokens = math.prod(token_sizes)
    a_full, outs = torch.ops.symm_mem.fused_all_gather_matmul(
        x_local.contiguous(), list(weights), 0, group_name, return_A=need_gathered
    )
    outs = [o[:num_tokens] if b is None else o[:num_tokens] + b for o, b in zip(outs, biases)]
    gathered = a_full[:num_tokens] if need_gathered else x_local.new_empty(num_tokens, x_local.shape[-1])
    return [gathered.reshape(*token_sizes, x_local.shape[-1]), *outs]


def mm_rs(a, weight, group_name, world_size):
    """MmRs by torch's fused_matmul_reduce_scatter, rows zero-padded to a multiple of TP."""
    _enable(group_name)
    pad = shard_rows(a.shape[0], world_size) * world_size - a.shape[0]
    if pad:
        a = F.pad(a, (0, 0, 0, pad))
    return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, weight, "sum", 0, group_name)


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
    """torch's fused_all_gather_scaled_matmul: FP8 rows and their row-wise scales gathered while the
    scaled matmuls of the chunks that arrived run. Policies choose it only where a calibration table
    measured it faster."""
    if x_local.shape[0] % FP8_ROW_ALIGN:
        return sequential.ag_scaled_mm(
            x_local, x_scale_local, weights, w_scales, biases, token_sizes, group_name, world_size, out_dtype
        )
    _enable(group_name)
    num_tokens = math.prod(token_sizes)
    a_full, outs = torch.ops.symm_mem.fused_all_gather_scaled_matmul(
        x_local.contiguous(),
        [w.t() for w in weights],
        x_scale_local.contiguous(),
        [s.reshape(1, -1).contiguous() for s in w_scales],
        0,
        group_name,
        list(biases),
        [None] * len(weights),
        [out_dtype] * len(weights),
        [False] * len(weights),
    )
    a_scale = torch.ops.tpweave.all_gather_tokens(x_scale_local, token_sizes, group_name, world_size)
    return [a_full[:num_tokens].reshape(*token_sizes, x_local.shape[-1]), a_scale, *[o[:num_tokens] for o in outs]]


def scaled_mm_rs(a, a_scale, weight, w_scale, group_name, world_size, out_dtype):
    """ScaledMmRs by torch's fused_scaled_matmul_reduce_scatter (padding rows get scale 1); shards whose
    shard_rows(N) rows are not a multiple of FP8_ROW_ALIGN take the sequential path."""
    if shard_rows(a.shape[0], world_size) % FP8_ROW_ALIGN:
        return sequential.scaled_mm_rs(a, a_scale, weight, w_scale, group_name, world_size, out_dtype)
    _enable(group_name)
    pad = shard_rows(a.shape[0], world_size) * world_size - a.shape[0]
    if pad:
        a, a_scale = F.pad(a.view(torch.uint8), (0, 0, 0, pad)).view(a.dtype), F.pad(a_scale, (0, 0, 0, pad), value=1.0)
    return torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
        a,
        weight.t(),
        a_scale.contiguous(),
        w_scale.reshape(1, -1).contiguous(),
        "sum",
        0,
        0,
        group_name,
        [a.shape[0], weight.shape[0]],
        None,
        None,
        out_dtype,
        False,
    )


SYMM_MEM_FUSED = Strategy(
    name="symm_mem_fused",
    ag_mm=ag_mm,
    mm_rs=mm_rs,
    ag_scaled_mm=ag_scaled_mm,
    scaled_mm_rs=scaled_mm_rs,
    available=_available,
)
