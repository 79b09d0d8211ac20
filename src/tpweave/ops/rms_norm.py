"""Residual add + RMSNorm, the op that follows every TP all-reduce in a pre-norm decoder:
h = s + residual (in the model dtype), y = rms_norm(h) * weight. Returns (y, h). An optional second
summand s2 (the partial sum a reduce-scatter received) is added to s first: s = dtype(s + s2).

Two weight orders exist in the wild and give different roundings, so both are kept:
- weight_in_fp32=False (Llama/HF): y = weight * dtype(h32 * rsqrt(mean(h32^2) + eps))
- weight_in_fp32=True (Gemma-style (1 + w) and F.rms_norm): y = dtype(h32 * rsqrt(...) * float(weight))

`add_rms_norm` runs one Triton kernel on CUDA (the reference's ops otherwise); the fused all-reduce
kernel in ops/strategies/triton_ar_norm.py shares `_norm_rows` so both round the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference is used
    triton = None


def out_dtype(x: Tensor, weight: Tensor, weight_in_fp32: bool) -> torch.dtype:
    """dtype of y: x's with weight_in_fp32, else the promotion of the weight's and x's."""
    return x.dtype if weight_in_fp32 else torch.promote_types(weight.dtype, x.dtype)


def add_rms_norm_reference(
    s: Tensor, residual: Tensor | None, weight: Tensor, *, eps: float, weight_in_fp32: bool, s2: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(y, h) of the module docstring in plain PyTorch ops: the reference the kernels round like."""
    s = s if s2 is None else s + s2
    h = s if residual is None else s + residual
    h32 = h.float()
    n32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    y = (n32 * weight.float()).to(h.dtype) if weight_in_fp32 else weight * n32.to(h.dtype)
    return y, h


def triton_supported(x: Tensor, weight: Tensor) -> bool:
    """Whether the Triton kernel takes x and weight: CUDA, fp32/bf16/fp16, a (H,) weight, H <= 32768 (False
    without Triton)."""
    return (
        triton is not None
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.dim() == 1
        and weight.shape[0] == x.shape[-1]
        and x.shape[-1] <= 32768
    )


def block_h(hidden: int) -> int:
    """Triton block width of one row of `hidden` elements: the next power of 2."""
    return triton.next_power_of_2(hidden)


def num_warps_for(hidden: int) -> int:
    """Warps per program of the norm kernels for rows of `hidden` elements."""
    return 4 if hidden <= 2048 else 8 if hidden <= 8192 else 16


if triton is not None:

    @triton.jit
    def _norm_rows(
        s,
        res_ptr,
        w,
        h_ptr,
        y_ptr,
        offs,
        mask,
        eps,
        H: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        WEIGHT_FP32: tl.constexpr,
    ):
        """s: one row's fp32 sum (BLOCK_H,); w: fp32 weight. Stores h and y at offs."""
        h = s.to(h_ptr.dtype.element_ty)  # the all-reduce's output, rounded to the model dtype
        if HAS_RESIDUAL:
            h = (h.to(tl.float32) + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(
                h_ptr.dtype.element_ty
            )
        tl.store(h_ptr + offs, h, mask=mask)
        h32 = h.to(tl.float32)
        n32 = h32 * tl.rsqrt(tl.sum(h32 * h32, axis=0) / H + eps)
        if WEIGHT_FP32:
            y = n32 * w
        else:
            y = n32.to(h_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(
        s_ptr,
        s2_ptr,
        res_ptr,
        w_ptr,
        h_ptr,
        y_ptr,
        eps,
        H: tl.constexpr,
        BLOCK_H: tl.constexpr,
        HAS_S2: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        WEIGHT_FP32: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        offs = row * H + cols
        s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_S2:
            s += tl.load(s2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        _norm_rows(s, res_ptr, w, h_ptr, y_ptr, offs, mask, eps, H, HAS_RESIDUAL, WEIGHT_FP32)


def add_rms_norm(
    s: Tensor, residual: Tensor | None, weight: Tensor, *, eps: float, weight_in_fp32: bool, s2: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(y, h): one kernel on CUDA, the reference elsewhere. s, s2 and residual: (..., H); weight: (H,)."""
    if not triton_supported(s, weight) or any(t is not None and t.dtype != s.dtype for t in (residual, s2)):
        return add_rms_norm_reference(s, residual, weight, eps=eps, weight_in_fp32=weight_in_fp32, s2=s2)
    hidden = s.shape[-1]
    s = s.contiguous()
    res = s if residual is None else residual.contiguous()
    h = torch.empty_like(s)
    y = torch.empty(s.shape, dtype=out_dtype(s, weight, weight_in_fp32), device=s.device)
    num_rows = s.numel() // hidden
    if num_rows:
        _add_rms_norm_kernel[(num_rows,)](
            s,
            s if s2 is None else s2.contiguous(),
            res,
            weight.contiguous(),
            h,
            y,
            eps,
            H=hidden,
            BLOCK_H=block_h(hidden),
            HAS_S2=s2 is not None,
            HAS_RESIDUAL=residual is not None,
            WEIGHT_FP32=weight_in_fp32,
            num_warps=num_warps_for(hidden),
        )
    return y, h
