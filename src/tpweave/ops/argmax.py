"""Greedy sampling's argmax over a step's logits (B, V) on the GPU, with torch.argmax's result: the first index of a
row's maximum, where a NaN counts as the maximum (the first NaN wins) and a row of -inf gives 0.

torch's reduction took 0.048 ms of a llama3-8b decode step at batch 256 on one H200 (256 x 128256 bf16 logits, 66 MB:
1.4 TB/s of a 4.8 TB/s HBM; benchmarks/results/2026-12-05/probes/decode_step_gpu_probe-llama3-8b-b256-1xH200.log),
a kernel beside the step's graph that the graph-replayed forward does not run. Here a row is cut into slices of
columns so that rows x slices fill every SM a few times over at any batch; a program keeps, per lane, the first
column holding the lane's largest value, then takes its slice's winner across lanes; a second launch picks each row's
winner among its slices in column order (none when a row is one slice). The engine samples with torch's argmax
until this one is measured faster on a GPU (benchmarks/probes/decode_step_gpu_probe.py times both).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tpweave.ops.device import num_sms

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 2048  # columns a program reads per step
PROGRAMS_PER_SM = 4
MAX_SLICES = 64
_NONE = 2**31 - 1  # a lane that has read no column yet


def supported(logits: Tensor) -> bool:
    """Whether the kernels take these logits: 2-D on CUDA, float, contiguous columns (False without Triton)."""
    return (
        triton is not None
        and logits.is_cuda
        and logits.dim() == 2
        and logits.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and logits.stride(1) == 1
        and 0 < logits.shape[1] < _NONE
    )


def slice_plan(rows: int, cols: int, num_sms: int) -> tuple[int, int]:
    """(slices per row, columns per slice) from shapes only: up to MAX_SLICES, enough for PROGRAMS_PER_SM programs
    per SM, none shorter than BLOCK columns; a slice a whole number of BLOCKs where a row has several (each program's
    loads then start aligned, and vectorize), every slice holding at least one column."""
    want = max(1, -(-PROGRAMS_PER_SM * num_sms // max(rows, 1)))
    slices = 1
    while slices < min(want, MAX_SLICES) and cols >= 2 * slices * BLOCK:
        slices *= 2
    if slices == 1:
        return 1, cols
    per_slice = -(-cols // (slices * BLOCK)) * BLOCK
    return -(-cols // per_slice), per_slice


if triton is not None:

    @triton.jit
    def _winner(best_v, best_i, NONE: tl.constexpr):
        """(value, index) of the first index of the largest value among the lanes (a NaN the largest), lanes that
        read nothing (index NONE) left out."""
        seen = best_i != NONE
        nan = (best_v != best_v) & seen
        has_nan = tl.max(nan.to(tl.int32), axis=0) > 0
        top = tl.max(tl.where(seen & ~nan, best_v, float("-inf")), axis=0)
        pick = tl.where(has_nan, nan, seen & (best_v == top))
        index = tl.min(tl.where(pick, best_i, NONE), axis=0)
        return tl.where(has_nan, float("nan"), top), index

    @triton.jit
    def _argmax_slices_kernel(x_ptr, stride_row, num_cols, cols_per_slice, val_ptr, idx_ptr, out_ptr, num_slices,
                              BLOCK: tl.constexpr, NONE: tl.constexpr, DIRECT: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        part = tl.program_id(1)
        start = part * cols_per_slice
        end = tl.minimum(start + cols_per_slice, num_cols)
        lanes = tl.arange(0, BLOCK)
        best_v = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.full([BLOCK], NONE, tl.int32)
        base = x_ptr + row.to(tl.int64) * stride_row
        for off in range(start, end, BLOCK):
            cols = off + lanes
            ok = cols < end
            v = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
            # a lane keeps its first column of its largest value: replaced only by a larger one, by a NaN where it
            # holds none, or on its first column
            take = ok & ((v > best_v) | ((v != v) & (best_v == best_v)) | (best_i == NONE))
            best_v = tl.where(take, v, best_v)
            best_i = tl.where(take, cols, best_i)
        value, index = _winner(best_v, best_i, NONE)
        if DIRECT:
            tl.store(out_ptr + row, index.to(tl.int64))
        else:
            tl.store(val_ptr + row * num_slices + part, value)
            tl.store(idx_ptr + row * num_slices + part, index)

    @triton.jit
    def _argmax_rows_kernel(val_ptr, idx_ptr, out_ptr, num_slices, SLICES: tl.constexpr, NONE: tl.constexpr):
        row = tl.program_id(0)
        s = tl.arange(0, SLICES)
        ok = s < num_slices
        v = tl.load(val_ptr + row * num_slices + s, mask=ok, other=float("-inf"))
        i = tl.load(idx_ptr + row * num_slices + s, mask=ok, other=NONE)
        _, index = _winner(v, i, NONE)
        tl.store(out_ptr + row, index.to(tl.int64))


def argmax_rows(logits: Tensor, *, out: Tensor | None = None) -> Tensor:
    """torch.argmax(logits, -1) (int64, (B,)), into `out` where given: the Triton kernels where `supported`, torch's
    reduction otherwise."""
    if not supported(logits) or logits.shape[0] == 0:
        return torch.argmax(logits, -1, out=out) if out is not None else torch.argmax(logits, -1)
    rows, cols = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    slices, per_slice = slice_plan(rows, cols, num_sms(logits.device))
    direct = slices == 1
    vals = out if direct else torch.empty((rows, slices), dtype=torch.float32, device=logits.device)
    idxs = out if direct else torch.empty((rows, slices), dtype=torch.int32, device=logits.device)
    _argmax_slices_kernel[(rows, slices)](
        logits, logits.stride(0), cols, per_slice, vals, idxs, out, slices,
        BLOCK=BLOCK, NONE=_NONE, DIRECT=direct, num_warps=8,
    )  # fmt: skip
    if not direct:
        _argmax_rows_kernel[(rows,)](vals, idxs, out, slices, SLICES=triton.next_power_of_2(slices), NONE=_NONE)
    return out
