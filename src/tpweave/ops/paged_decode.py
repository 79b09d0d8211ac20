"""Paged attention for one query row per token (decode) as a Triton kernel with the context split
across programs (flash-decoding), so batch 1 with a long context still fills the GPU.

Legend: M query tokens, H q heads, K kv heads (GQA group H // K), D head dim, S context splits.
Each program takes one token, one kv head (all GROUP q heads of it at once, padded to 16 rows for
tl.dot) and one split of the context; a second step merges the splits by their log-sum-exp.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path in attention.py is used
    triton = None

BLOCK_N = 64  # context tokens per inner iteration


def supported(q_MHD: Tensor, k_cache: Tensor) -> bool:
    """Whether the Triton decode kernel takes these inputs: CUDA, fp16/bf16 q and cache of the same dtype, a
    head dim that is a power of 2 >= 16, at most 64 q heads per kv head (False without Triton)."""
    d = q_MHD.shape[-1]
    return (
        triton is not None
        and q_MHD.is_cuda
        and q_MHD.dtype in (torch.float16, torch.bfloat16)
        and k_cache.dtype == q_MHD.dtype
        and d >= 16
        and d & (d - 1) == 0
        and q_MHD.shape[1] // k_cache.shape[1] <= 64
    )


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        seq_ptr,
        kv_len_ptr,
        o_ptr,
        lse_ptr,
        stride_qm,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        stride_tb,
        stride_om,
        stride_oh,
        stride_os,
        stride_lm,
        stride_lh,
        scale,
        block_size,
        tokens_per_split,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        tok = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq = tl.load(seq_ptr + tok)
        kv_len = tl.load(kv_len_ptr + tok)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, kv_len)
        rows = tl.arange(0, GROUP_PAD)
        row_ok = rows < GROUP
        heads = kvh * GROUP + rows
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + tok * stride_qm + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for n0 in range(start, end, BLOCK):
            t = n0 + tl.arange(0, BLOCK)
            t_ok = t < end
            block = tl.load(tables_ptr + seq * stride_tb + t // block_size, mask=t_ok, other=0)
            slot = block.to(tl.int64) * block_size + t % block_size
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=t_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(t_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=t_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(
            o_ptr + tok * stride_om + heads[:, None] * stride_oh + split * stride_os + d[None, :],
            out,
            mask=row_ok[:, None],
        )
        tl.store(lse_ptr + tok * stride_lm + heads * stride_lh + split, lse, mask=row_ok)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits(num_tokens: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """From shapes only (no host sync, fixed per CUDA-graph bucket): enough programs for 2 waves."""
    want = -(-2 * _num_sms(device.index or 0) // max(num_tokens * num_kv_heads, 1))
    return max(1, min(want, -(-max_context // BLOCK_N)))


def paged_decode(
    q_MHD: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_of_token: Tensor,
    kv_len_of_token: Tensor,
    block_size: int,
    scale: float,
) -> Tensor:
    """Token i attends to the first kv_len_of_token[i] positions of sequence seq_of_token[i]."""
    num_tokens, num_heads, head_dim = q_MHD.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    splits = num_splits(num_tokens, num_kv_heads, max_context, q_MHD.device)
    per_split = -(-max(max_context, 1) // splits)
    per_split = -(-per_split // BLOCK_N) * BLOCK_N
    splits = -(-max(max_context, 1) // per_split)
    q_MHD = q_MHD.contiguous()
    o_MHSD = torch.empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=q_MHD.device)
    lse_MHS = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q_MHD.device)
    _paged_decode_kernel[(num_tokens, num_kv_heads, splits)](
        q_MHD,
        k_cache,
        v_cache,
        block_tables,
        seq_of_token,
        kv_len_of_token,
        o_MHSD,
        lse_MHS,
        q_MHD.stride(0),
        q_MHD.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        block_tables.stride(0),
        o_MHSD.stride(0),
        o_MHSD.stride(1),
        o_MHSD.stride(2),
        lse_MHS.stride(0),
        lse_MHS.stride(1),
        scale,
        block_size,
        per_split,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK=BLOCK_N,
    )
    if splits == 1:
        return o_MHSD[:, :, 0].to(q_MHD.dtype)
    weight_MHS = torch.exp(lse_MHS - lse_MHS.amax(-1, keepdim=True))  # empty splits: exp(-inf) = 0
    out = (o_MHSD * weight_MHS[..., None]).sum(2) / weight_MHS.sum(-1)[..., None]
    return out.to(q_MHD.dtype)
