"""FP8 (e4m3) linear algebra: activation quantization and the scaled matmul.

Scales are dequantization factors (real = fp8 * scale), fp32. Weights w_NK are quantized per output
channel (w_scale_N; a per-tensor scale is the same value on every channel); activations per token
(dynamic: scale from each row's amax) or with one static scale. Both quantizations are token-wise,
so under sequence parallelism they run on the token shard and the all-gather moves FP8 bytes.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_MIN_SCALE = 1e-12


def quantize_rows(x_MK: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-token quantization: (x_fp8_MK, scale_M1)."""
    x32 = x_MK.float()
    scale_M1 = x32.abs().amax(-1, keepdim=True).clamp(min=_MIN_SCALE) / FP8_MAX
    return (x32 / scale_M1).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale_M1


def quantize_static(x_MK: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """Static quantization with one scale; the scale comes back as (M, 1) for the row-wise matmul."""
    x32 = x_MK.float()
    xq = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return xq, scale.reshape(1, 1).expand(x32.shape[0], 1)


def quantize_weight(w_NK: Tensor, *, per_channel: bool) -> tuple[Tensor, Tensor]:
    """(w_fp8_NK, scale_N) or (w_fp8_NK, scale of shape ()) for per-tensor."""
    w32 = w_NK.float()
    amax = w32.abs().amax(-1) if per_channel else w32.abs().amax()
    scale = amax.clamp(min=_MIN_SCALE) / FP8_MAX
    wq = (w32 / (scale[:, None] if per_channel else scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return wq, scale


@functools.lru_cache(maxsize=8)
def has_scaled_mm(device_type: str) -> bool:
    """Whether torch._scaled_mm runs row-wise scaled FP8 matmuls on this device type."""
    try:
        a = torch.zeros(16, 16, device=device_type).to(FP8)
        ones = torch.ones(16, 1, device=device_type)
        torch._scaled_mm(a, a.t(), scale_a=ones, scale_b=ones.t(), out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@torch.library.custom_op("tpweave::scaled_mm", mutates_args=())
def scaled_mm(
    x_fp8_MK: Tensor,
    w_fp8_NK: Tensor,
    x_scale_M1: Tensor,
    w_scale_N: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """(x * x_scale) @ (w * w_scale)^T (+ bias) in out_dtype: torch._scaled_mm where the device has
    row-wise scaled FP8 matmuls, else emulated (dequantize, matmul in fp32). One opaque op: traced,
    torch._scaled_mm's size checks would specialize M == 1 and compile a second graph."""
    # Row-wise scaled FP8 matmuls produce bf16 (CUDA supports no other output with row-wise scales).
    # The scales must be strided (1, 1) even in their size-1 dims, which .contiguous() does not ensure.
    if out_dtype == torch.bfloat16 and has_scaled_mm(x_fp8_MK.device.type):
        y = torch._scaled_mm(
            x_fp8_MK,
            w_fp8_NK.t(),
            scale_a=x_scale_M1.reshape(-1).contiguous().unsqueeze(1),
            scale_b=w_scale_N.reshape(-1).contiguous().unsqueeze(0),
            out_dtype=out_dtype,
        )
    else:
        y = ((x_fp8_MK.float() * x_scale_M1) @ (w_fp8_NK.float() * w_scale_N.view(-1, 1)).t()).to(out_dtype)
    return y if bias is None else y + bias


@scaled_mm.register_fake
def _(x_fp8_MK, w_fp8_NK, x_scale_M1, w_scale_N, bias, out_dtype):
    return x_fp8_MK.new_empty(x_fp8_MK.shape[0], w_fp8_NK.shape[0], dtype=out_dtype)
