"""Tensor-parallel building blocks. Parallelism lives here, never in the model's forward.

Shapes: M tokens, H hidden, V vocab; a `_local` size is the per-rank share (size / TP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpweave.ops import fp8, rope
from tpweave.ops.collectives import all_gather_dim0, all_reduce
from tpweave.runtime.context import TPContext


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


@dataclass(frozen=True)
class Quant:
    """How a linear layer's weights and inputs are stored: None = in the model dtype; "fp8" = e4m3
    weights with per-output-channel scales and per-token ("dynamic") or "static" input scales."""

    method: str | None = None
    activation_scheme: str = "dynamic"


class _Linear(nn.Module):
    """weight (N, K) in the model dtype, or FP8 with weight_scale (N,) [+ input_scale ()]."""

    def _init_weights(self, n: int, k: int, *, quant: Quant, dtype: torch.dtype, device: torch.device) -> None:
        self.quant, self.out_dtype = quant, dtype
        if quant.method is None:
            self.weight = _param(n, k, dtype=dtype, device=device)
        elif quant.method == "fp8":
            self.weight = _param(n, k, dtype=fp8.FP8, device=device)
            self.weight_scale = _param(n, dtype=torch.float32, device=device)
            if quant.activation_scheme == "static":
                self.input_scale = _param(dtype=torch.float32, device=device)
            elif quant.activation_scheme != "dynamic":
                raise ValueError(
                    f"FP8 activation_scheme must be 'dynamic' or 'static', got {quant.activation_scheme!r}"
                )
        else:
            raise ValueError(f"unsupported quantization {quant.method!r} (supported: fp8)")

    def _matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.quant.method is None:
            return F.linear(x, self.weight, bias)
        if self.quant.activation_scheme == "static":
            xq, x_scale = fp8.quantize_static(x, self.input_scale)
        else:
            xq, x_scale = fp8.quantize_rows(x)
        return torch.ops.tpweave.scaled_mm(xq, self.weight, x_scale, self.weight_scale, bias, self.out_dtype)


class ColumnParallelLinear(_Linear):
    """y_local = x @ W_local^T: output features split over ranks, input replicated, no communication."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp: TPContext,
        bias: bool,
        dtype: torch.dtype,
        quant: Quant = Quant(),
    ):
        super().__init__()
        self._init_weights(out_features // tp.world_size, in_features, quant=quant, dtype=dtype, device=tp.device)
        self.bias = _param(out_features // tp.world_size, dtype=dtype, device=tp.device) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        """x (M, K) -> this rank's output features (M, N/TP), bias added."""
        return self._matmul(x, self.bias)


class RowParallelLinear(_Linear):
    """y = all_reduce(x_local @ W_local^T): input features split over ranks, output summed over ranks.

    With FP8 and dynamic scales each rank quantizes its own K-slice of a token (scale from that
    slice's amax), so TP=N differs from TP=1 by quantization rounding, not by more."""

    def __init__(
        self, in_features: int, out_features: int, *, tp: TPContext, dtype: torch.dtype, quant: Quant = Quant()
    ):
        super().__init__()
        self.group_name = tp.comm_group_name
        self._init_weights(out_features, in_features // tp.world_size, quant=quant, dtype=dtype, device=tp.device)

    def forward(self, x: Tensor) -> Tensor:
        """x (M, K/TP), this rank's input features -> (M, N) summed over ranks."""
        return all_reduce(self._matmul(x, None), self.group_name)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds V/TP rows; ids outside its range contribute zeros to the all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.num_local = vocab_size // tp.world_size
        self.start = tp.rank * self.num_local
        self.group_name = tp.comm_group_name
        self.weight = _param(self.num_local, hidden_size, dtype=dtype, device=tp.device)

    def forward(self, ids_M: Tensor) -> Tensor:
        """ids (M,) -> embeddings (M, H), each row from the rank that holds its vocabulary entry."""
        local = ids_M - self.start
        in_range = (local >= 0) & (local < self.num_local)
        x_MH = F.embedding(torch.where(in_range, local, 0), self.weight)
        return all_reduce(x_MH * in_range.unsqueeze(-1).to(x_MH.dtype), self.group_name)


class ParallelLMHead(nn.Module):
    """logits (M, V) from vocab-split weights; the per-rank (M, V/TP) blocks are gathered."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.world_size = tp.world_size
        self.group_name = tp.comm_group_name
        self.weight = _param(vocab_size // tp.world_size, hidden_size, dtype=dtype, device=tp.device)

    def forward(self, x_MH: Tensor) -> Tensor:
        """x (M, H) -> logits (M, V) over the whole vocabulary (this rank's (M, V/TP) without a TP group)."""
        logits_local = F.linear(x_MH, self.weight)
        if self.group_name is None:
            return logits_local
        num_tokens = logits_local.shape[0]
        gathered = all_gather_dim0(logits_local, self.world_size, self.group_name)  # (TP*M, V/TP)
        # cat of the per-rank blocks, not permute+reshape: reshape would guard on M == 1 (a recompile).
        return torch.cat(gathered.view(self.world_size, num_tokens, -1).unbind(0), dim=-1)


class RMSNorm(nn.Module):
    """Written as plain ops on purpose: the SP pass must handle norms that are not one fused op."""

    def __init__(self, hidden_size: int, *, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = _param(hidden_size, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., H) divided by its root mean square over H (computed in fp32), times the weight."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """RoPE inverse frequencies (head_dim/2,) fp32 for base `theta`, with HF's rope_scaling (llama3, linear,
    default or None) applied; ValueError for another type."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(is_mid, mid, scaled).float()
    if kind in ("linear",):
        return (inv_freq / scaling["factor"]).float()
    if kind in ("default", None):
        return inv_freq.float()
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear, default)")


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE, as in HF Llama checkpoints; cos/sin cached per position."""

    def __init__(self, head_dim: int, *, theta: float, scaling: dict | None, max_positions: int, device: torch.device):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # (P, D/2)
        self.register_buffer("cos_sin", torch.cat([angles.cos(), angles.sin()], dim=-1).to(device), persistent=False)

    def forward(self, positions_M: Tensor, q_MHD: Tensor, k_MKD: Tensor) -> tuple[Tensor, Tensor]:
        """q (M, H, D) and k (M, K, D) rotated by the angles of their tokens' positions (M,)."""
        return rope.rotate(q_MHD, self.cos_sin, positions_M), rope.rotate(k_MKD, self.cos_sin, positions_M)
