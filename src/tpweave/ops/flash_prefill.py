"""Causal attention of fresh sequences packed in one batch (prefill with no cached context), in one Triton kernel.

Legend: M packed tokens, B sequences (cu_seqlens (B + 1,) int32 on the GPU), H q heads, K kv heads (GQA: q head h
reads kv head h // (H / K)), D head dim. A program takes one block of BLOCK_M queries of one sequence and one q
head, and walks that sequence's keys up to its diagonal: the blocks left of the diagonal unmasked, the diagonal
block masked. Programs map to (sequence, query block) with no host sync: sequence b's blocks are programs
cu_seqlens[b] // BLOCK_M + b onwards (at most M // BLOCK_M + B programs in all, the unused ones return at once),
found by a binary search over cu_seqlens; the last query blocks (the most keys) are launched first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from tpweave.ops import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: attention.py's reference path is used
    triton = None


@dataclass(frozen=True)
class PrefillTuning:
    """Launch parameters: the best of benchmarks/probes/flash_prefill_probe.py's settings on one H200 (llama3-8b
    heads; one sequence of 512-4096 tokens, 16 of 128, 100 + 900 + 1048): 326 TFLOP/s at 2048 tokens where FA2
    varlen reaches 201 and cuDNN 262 (benchmarks/results/2026-12-03/probes/flash-prefill-probe-1xH200.json)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_TUNING = PrefillTuning()


def supported(q_MHD: Tensor) -> bool:
    """Whether the kernel takes q: CUDA, fp16/bf16, a head dim that is a power of 2 in 16..256 (False without
    Triton)."""
    d = q_MHD.shape[-1]
    return (
        triton is not None
        and q_MHD.is_cuda
        and q_MHD.dtype in (torch.float16, torch.bfloat16)
        and 16 <= d <= 256
        and d & (d - 1) == 0
    )


if triton is not None:

    @triton.jit
    def _sequence_of(cu_ptr, pid, num_seqs, BLOCK_M: tl.constexpr):
        """The last sequence b whose first program (cu[b] // BLOCK_M + b) is at or before pid."""
        lo = 0
        hi = num_seqs
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            if tl.load(cu_ptr + mid) // BLOCK_M + mid <= pid:
                lo = mid
            else:
                hi = mid
        return lo

    @triton.jit
    def _flash_prefill_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, num_seqs, qk_scale,
        stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh, stride_om, stride_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pid = tl.num_programs(0) - 1 - tl.program_id(0)
        head = tl.program_id(1)
        pdl.wait_and_release(PDL)
        seq = _sequence_of(cu_ptr, pid, num_seqs, BLOCK_M)
        start = tl.load(cu_ptr + seq)
        seq_len = tl.load(cu_ptr + seq + 1) - start
        q_block = pid - (start // BLOCK_M + seq)
        if q_block * BLOCK_M < seq_len:
            offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = tl.arange(0, BLOCK_N)
            d = tl.arange(0, HEAD_DIM)
            q_ptrs = q_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_qm + head * stride_qh + d[None, :]
            q = tl.load(q_ptrs, mask=(offs_m < seq_len)[:, None], other=0.0)
            kv_head = head // GROUP
            k_base = k_ptr + start.to(tl.int64) * stride_km + kv_head * stride_kh
            v_base = v_ptr + start.to(tl.int64) * stride_vm + kv_head * stride_vh
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
            diagonal = q_block * BLOCK_M  # keys before it are seen by every query of the block, and all exist
            for n in range(0, diagonal, BLOCK_N):
                k = tl.load(k_base + (n + offs_n)[None, :] * stride_km + d[:, None])  # (D, BLOCK_N)
                s = tl.dot(q, k) * qk_scale
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.math.exp2(s - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_base + (n + offs_n)[:, None] * stride_vm + d[None, :])
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
                m_i = m_new
            # the diagonal block: key j is seen by query i when j <= i (and j exists); key `diagonal` is seen by
            # every row, padding rows included, so no row is all -inf
            for n in range(diagonal, tl.minimum(diagonal + BLOCK_M, seq_len), BLOCK_N):
                key = n + offs_n
                key_ok = key < seq_len
                k = tl.load(k_base + key[None, :] * stride_km + d[:, None], mask=key_ok[None, :], other=0.0)
                s = tl.dot(q, k) * qk_scale
                s = tl.where((key[None, :] <= offs_m[:, None]) & key_ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.math.exp2(s - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_base + key[:, None] * stride_vm + d[None, :], mask=key_ok[:, None], other=0.0)
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
                m_i = m_new
            out = acc / l_i[:, None]
            o_ptrs = o_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_om + head * stride_oh + d[None, :]
            tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(offs_m < seq_len)[:, None])


def flash_prefill(
    q_MHD: Tensor,
    k_MKD: Tensor,
    v_MKD: Tensor,
    cu_seqlens: Tensor,
    scale: float,
    *,
    tuning: PrefillTuning = DEFAULT_TUNING,
) -> Tensor:
    """Causal attention within each sequence of the packed batch (module doc: layout); (M, H, D) contiguous in q's
    dtype. Any token and head strides (views of a fused QKV projection are read in place); CUDA only
    (`supported`)."""
    num_tokens, num_heads, head_dim = q_MHD.shape
    num_kv_heads = k_MKD.shape[1]
    assert num_heads % num_kv_heads == 0 and tuning.block_m % tuning.block_n == 0
    q_MHD, k_MKD, v_MKD = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_MHD, k_MKD, v_MKD))
    out = torch.empty(q_MHD.shape, dtype=q_MHD.dtype, device=q_MHD.device)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    on = pdl.enabled(q_MHD.device)
    grid = (triton.cdiv(num_tokens, tuning.block_m) + num_seqs, num_heads)
    _flash_prefill_kernel[grid](
        q_MHD, k_MKD, v_MKD, out, cu, num_seqs, scale * math.log2(math.e),
        q_MHD.stride(0), q_MHD.stride(1), k_MKD.stride(0), k_MKD.stride(1), v_MKD.stride(0), v_MKD.stride(1),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=tuning.block_m, BLOCK_N=tuning.block_n, PDL=on,
        num_warps=tuning.num_warps, num_stages=tuning.num_stages, launch_pdl=on,
    )  # fmt: skip
    return out
