"""Paged attention for decode (one new token per sequence) in at most two Triton kernels per layer:
the first writes the new tokens' K/V into the page pool and attends over the context, split across
programs (flash-decoding) when batch x kv heads cannot fill the GPU; the second merges the splits.

Legend: B sequences (= tokens), H q heads, K kv heads (GQA group H // K), D head dim, S context splits.
A program takes one sequence, one kv head (all GROUP q heads of it at once, padded to 16 rows for
tl.dot) and one split of the context. Positions < context_len - 1 are read from the cache; the new
token (position context_len - 1) is taken from k_new/v_new, and the program whose split holds it also
stores it at its slot, so no program reads a slot that another one writes in the same launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tpweave.ops import pdl
from tpweave.ops.device import num_sms

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path in attention.py is used
    triton = None


@dataclass(frozen=True)
class DecodeTuning:
    """Launch parameters: block_n context tokens per inner iteration, programs_per_sm the target
    occupancy that decides the split count (from shapes only, fixed per CUDA-graph bucket), prefetch: the context
    length, block table and first K/V tile are read before the PDL wait (ops/pdl.py; so context_lens and
    block_tables must be step inputs, not outputs of the kernels just before). The defaults
    come from benchmarks/probes/decode_kernel_probe.py on one H200 (llama3-8b shapes, batch 1-256, context
    1K-8K): within 7% of the best setting of each shape."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 2
    prefetch: bool = True


DEFAULT_TUNING = DecodeTuning()


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
    def _kv_tile(k_ptr, v_ptr, tables_ptr, seq, kvh, t, cached_end, block_size, stride_tb, stride_ks, stride_kh,
                 stride_vs, stride_vh, d):  # fmt: skip
        """K and V (BLOCK, HEAD_DIM) of kv head kvh at sequence seq's positions t (zeros from cached_end on), and
        the mask of the positions that count."""
        t_ok = t < cached_end
        block = tl.load(tables_ptr + seq * stride_tb + t // block_size, mask=t_ok, other=0)
        slot = block.to(tl.int64) * block_size + t % block_size
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=t_ok[:, None], other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=t_ok[:, None], other=0.0)
        return k, v, t_ok

    @triton.jit
    def _attend_tile(q, k, v, t_ok, m_i, l_i, acc, scale):
        """Online softmax: the running max m_i, sum l_i and output acc of q's rows after one more K/V tile."""
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _decode_kernel(
        q_ptr,
        kn_ptr,
        vn_ptr,
        k_ptr,
        v_ptr,
        slot_ptr,
        tables_ptr,
        ctx_ptr,
        o_ptr,
        lse_ptr,
        stride_qm,
        stride_qh,
        stride_knm,
        stride_knh,
        stride_vnm,
        stride_vnh,
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
        SPLIT: tl.constexpr,
        PREFETCH: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # With PREFETCH, the first tile of cached K/V (and the context length and block table: step inputs, and K/V
        # that earlier steps wrote) is loaded before the PDL wait, while the kernel before this one finishes; q and
        # the new token's K/V are read after it.
        if not PREFETCH:
            pdl.wait_and_release(PDL)
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        kv_len = tl.load(ctx_ptr + seq)
        new_pos = kv_len - 1
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, kv_len)
        cached_end = tl.minimum(end, new_pos)
        d = tl.arange(0, HEAD_DIM)
        t = start + tl.arange(0, BLOCK)
        k, v, t_ok = _kv_tile(k_ptr, v_ptr, tables_ptr, seq, kvh, t, cached_end, block_size, stride_tb, stride_ks,
                              stride_kh, stride_vs, stride_vh, d)  # fmt: skip
        if PREFETCH:
            pdl.wait_and_release(PDL)
        rows = tl.arange(0, GROUP_PAD)
        row_ok = rows < GROUP
        heads = kvh * GROUP + rows
        q = tl.load(q_ptr + seq * stride_qm + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        if start < cached_end:
            m_i, l_i, acc = _attend_tile(q, k, v, t_ok, m_i, l_i, acc, scale)
        for n0 in range(start + BLOCK, cached_end, BLOCK):
            k, v, t_ok = _kv_tile(k_ptr, v_ptr, tables_ptr, seq, kvh, n0 + tl.arange(0, BLOCK), cached_end, block_size,
                                  stride_tb, stride_ks, stride_kh, stride_vs, stride_vh, d)  # fmt: skip
            m_i, l_i, acc = _attend_tile(q, k, v, t_ok, m_i, l_i, acc, scale)
        if (new_pos >= start) & (new_pos < end):
            k_new = tl.load(kn_ptr + seq * stride_knm + kvh * stride_knh + d)
            v_new = tl.load(vn_ptr + seq * stride_vnm + kvh * stride_vnh + d)
            slot_new = tl.load(slot_ptr + seq)
            tl.store(k_ptr + slot_new * stride_ks + kvh * stride_kh + d, k_new)
            tl.store(v_ptr + slot_new * stride_vs + kvh * stride_vh + d, v_new)
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
            m_new = tl.maximum(m_i, s_new)
            p_new = tl.exp(s_new - m_new)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
            m_i = m_new
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        o_offs = seq * stride_om + heads[:, None] * stride_oh + split * stride_os + d[None, :]
        if SPLIT:
            tl.store(o_ptr + o_offs, out, mask=row_ok[:, None])
            lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + seq * stride_lm + heads * stride_lh + split, lse, mask=row_ok)
        else:
            tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _merge_kernel(
        o_ptr,
        lse_ptr,
        out_ptr,
        num_splits,
        stride_om,
        stride_oh,
        stride_os,
        stride_lm,
        stride_lh,
        stride_outm,
        stride_outh,
        SPLITS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl.wait_and_release(PDL)
        seq = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, SPLITS_PAD)
        s_ok = s < num_splits
        d = tl.arange(0, HEAD_DIM)
        lse = tl.load(lse_ptr + seq * stride_lm + head * stride_lh + s, mask=s_ok, other=float("-inf"))
        w = tl.exp(lse - tl.max(lse, 0))  # splits past the context: exp(-inf) = 0
        o = tl.load(
            o_ptr + seq * stride_om + head * stride_oh + s[:, None] * stride_os + d[None, :],
            mask=s_ok[:, None],
            other=0.0,
        )
        out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out_ptr + seq * stride_outm + head * stride_outh + d, out.to(out_ptr.dtype.element_ty))


def split_plan(
    num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int, tuning: DecodeTuning = DEFAULT_TUNING
) -> tuple[int, int]:
    """(splits, tokens per split) from shapes only: enough programs for tuning.programs_per_sm per SM, each
    split a whole number of block_n tiles."""
    want = -(-tuning.programs_per_sm * num_sms // max(num_seqs * num_kv_heads, 1))
    tiles = -(-max(max_context, 1) // tuning.block_n)
    splits = max(1, min(want, tiles))
    per_split = -(-tiles // splits) * tuning.block_n
    return -(-max(max_context, 1) // per_split), per_split


def paged_decode(
    q_MHD: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    block_size: int,
    scale: float,
    tuning: DecodeTuning | None = None,
) -> Tensor:
    """Sequence b's one new token (q_MHD[b], K/V k_new[b] / v_new[b], stored at slot_mapping[b]) attends to
    the first context_lens[b] positions of its blocks block_tables[b]; (B, H, D) in q's dtype. Inputs may be
    strided views (the rows of a fused QKV output); the last dim must be contiguous."""
    tuning = tuning or DEFAULT_TUNING
    num_seqs, num_heads, head_dim = q_MHD.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    for name, t in (("q", q_MHD), ("k_new", k_new), ("v_new", v_new), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.stride(-1) == 1, f"{name} needs a contiguous head dim"
    splits, per_split = split_plan(
        num_seqs, num_kv_heads, block_tables.shape[1] * block_size, num_sms(q_MHD.device), tuning
    )
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q_MHD.dtype, device=q_MHD.device)
    on = pdl.enabled(q_MHD.device)
    if splits > 1:
        o = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q_MHD.device)
        lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q_MHD.device)
        o_strides, lse_strides = (o.stride(0), o.stride(1), o.stride(2)), (lse.stride(0), lse.stride(1))
    else:
        o, lse = out, out  # lse unused
        o_strides, lse_strides = (out.stride(0), out.stride(1), 0), (0, 0)
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        q_MHD,
        k_new,
        v_new,
        k_cache,
        v_cache,
        slot_mapping,
        block_tables,
        context_lens,
        o,
        lse,
        q_MHD.stride(0),
        q_MHD.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        block_tables.stride(0),
        *o_strides,
        *lse_strides,
        scale,
        block_size,
        per_split,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK=tuning.block_n,
        SPLIT=splits > 1,
        PREFETCH=tuning.prefetch,
        PDL=on,
        num_warps=tuning.num_warps,
        num_stages=tuning.num_stages,
        launch_pdl=on,
    )
    if splits > 1:
        _merge_kernel[(num_seqs, num_heads)](
            o,
            lse,
            out,
            splits,
            *o_strides,
            *lse_strides,
            out.stride(0),
            out.stride(1),
            SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
            HEAD_DIM=head_dim,
            PDL=on,
            num_warps=4,
            launch_pdl=on,
        )
    return out
