"""Causal attention of fresh sequences packed in one batch (prefill with no cached context), in one Triton kernel.

Legend: M packed tokens, B sequences (cu_seqlens (B + 1,) int32 on the GPU), H q heads, K kv heads (GQA: q head h
reads kv head h // (H / K)), D head dim. A program takes one block of BLOCK_M queries of one sequence and one q
head, and walks that sequence's keys up to its diagonal: the blocks left of the diagonal unmasked, the diagonal
block masked. Programs map to (sequence, query block) with no host sync: sequence b's blocks are programs
cu_seqlens[b] // BLOCK_M + b onwards (at most M // BLOCK_M + B programs in all, the unused ones return at once),
found by a binary search over cu_seqlens; the last query blocks (the most keys) are launched first.

`paged_prefill` is the same walk over a paged KV cache, for steps where some sequence has cached context (chunked
prefill, decodes mixed with prefill chunks): the new tokens of sequence b are its last ones, keys come from the page
pool through the block table (ops/paged_decode.py's tile loader), and no context is gathered first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from tpweave.ops import paged_decode, pdl

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
    pack_gqa: bool = False  # paged kernel: a block's rows are (token, q head) pairs of one kv head


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
    def _attend(q, k_DN, v_ND, m_i, l_i, acc, qk_scale, visible, MASKED: tl.constexpr):
        """Online softmax (base 2: qk_scale holds log2 e): the running max m_i, sum l_i and output acc of q's rows
        after one more tile of keys (K transposed, (D, BLOCK_N)); with MASKED, only where `visible`."""
        s = tl.dot(q, k_DN) * qk_scale
        if MASKED:
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v_ND.dtype), v_ND, acc * alpha[:, None])
        return m_new, l_i, acc

    # num_seqs changes every step: not specialized (Triton would compile a variant for 1 and for multiples of 16)
    @triton.jit(do_not_specialize=["num_seqs"])
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
                v = tl.load(v_base + (n + offs_n)[:, None] * stride_vm + d[None, :])
                m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, qk_scale, None, False)
            # the diagonal block: key j is seen by query i when j <= i (and j exists); key `diagonal` is seen by
            # every row, padding rows included, so no row is all -inf
            for n in range(diagonal, tl.minimum(diagonal + BLOCK_M, seq_len), BLOCK_N):
                key = n + offs_n
                key_ok = key < seq_len
                k = tl.load(k_base + key[None, :] * stride_km + d[:, None], mask=key_ok[None, :], other=0.0)
                v = tl.load(v_base + key[:, None] * stride_vm + d[None, :], mask=key_ok[:, None], other=0.0)
                visible = (key[None, :] <= offs_m[:, None]) & key_ok[None, :]
                m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, qk_scale, visible, True)
            out = acc / l_i[:, None]
            o_ptrs = o_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_om + head * stride_oh + d[None, :]
            tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(offs_m < seq_len)[:, None])

    @triton.jit(do_not_specialize=["num_seqs"])
    def _paged_prefill_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, ctx_ptr, tables_ptr, num_seqs, min_q, max_q, qk_scale, block_size,
        stride_qm, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb, stride_om, stride_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PACK_GQA: tl.constexpr, SEQ_BLOCKS: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        # rows of a block: with PACK_GQA, TOKENS tokens x the GROUP q heads of kv head program_id(1) (K/V read once
        # for the group); otherwise BLOCK_M tokens of q head program_id(1)
        ROWS_PER_TOKEN: tl.constexpr = GROUP if PACK_GQA else 1
        TOKENS: tl.constexpr = BLOCK_M // ROWS_PER_TOKEN
        pid = tl.num_programs(0) - 1 - tl.program_id(0)
        pdl.wait_and_release(PDL)
        if SEQ_BLOCKS > 0:  # a launch of short sequences only: SEQ_BLOCKS programs per sequence, no search
            seq = pid // SEQ_BLOCKS
            start = tl.load(cu_ptr + seq)
            q_block = pid % SEQ_BLOCKS
        else:
            seq = _sequence_of(cu_ptr, pid, num_seqs, TOKENS)
            start = tl.load(cu_ptr + seq)
            q_block = pid - (start // TOKENS + seq)
        q_len = tl.load(cu_ptr + seq + 1) - start
        # this launch takes the sequences of min_q <= q_len < max_q (paged_prefill: one launch per row block)
        if (q_block * TOKENS < q_len) & (q_len >= min_q) & (q_len < max_q):
            kv_len = tl.load(ctx_ptr + seq)
            r = tl.arange(0, BLOCK_M)
            tok = q_block * TOKENS + r // ROWS_PER_TOKEN
            if PACK_GQA:
                kv_head = tl.program_id(1)
                head = kv_head * GROUP + r % GROUP
            else:
                head = tl.program_id(1) + 0 * r
                kv_head = tl.program_id(1) // GROUP
            row_ok = (tok < q_len) & (r < TOKENS * ROWS_PER_TOKEN)
            pos = kv_len - q_len + tok  # token i of the sequence's new ones sits at position kv_len - q_len + i
            d = tl.arange(0, HEAD_DIM)
            rows = (start + tok).to(tl.int64)
            q = tl.load(q_ptr + rows[:, None] * stride_qm + head[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None], other=0.0)  # fmt: skip
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
            first = kv_len - q_len + q_block * TOKENS  # keys before it are seen by every token of the block
            unmasked_end = first // BLOCK_N * BLOCK_N
            for n in range(0, unmasked_end, BLOCK_N):
                k, v, _ = paged_decode._kv_tile(k_ptr, v_ptr, tables_ptr, seq, kv_head, n + tl.arange(0, BLOCK_N),
                                                kv_len, block_size, stride_tb, stride_ks, stride_kh, stride_vs,
                                                stride_vh, d)  # fmt: skip
                m_i, l_i, acc = _attend(q, tl.trans(k), v, m_i, l_i, acc, qk_scale, None, False)
            # then up to the block's last token, causally; key `first` is seen by every row, padding rows (past the
            # sequence: positions >= kv_len) included, so no row is all -inf
            for n in range(unmasked_end, tl.minimum(first + TOKENS, kv_len), BLOCK_N):
                key = n + tl.arange(0, BLOCK_N)
                k, v, key_ok = paged_decode._kv_tile(k_ptr, v_ptr, tables_ptr, seq, kv_head, key, kv_len, block_size,
                                                     stride_tb, stride_ks, stride_kh, stride_vs, stride_vh,
                                                     d)  # fmt: skip
                visible = (key[None, :] <= pos[:, None]) & key_ok[None, :]
                m_i, l_i, acc = _attend(q, tl.trans(k), v, m_i, l_i, acc, qk_scale, visible, True)
            out = acc / l_i[:, None]
            o_ptrs = o_ptr + rows[:, None] * stride_om + head[:, None] * stride_oh + d[None, :]
            tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


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


# sequences of fewer new tokens than this (decodes, speculative tokens) get their own launch in short row blocks
SHORT_ROWS = 4
# rows of 16: 16 // GROUP tokens x each q head of a kv head, so a decode reads its K/V once per kv head (64 decodes
# at context 1024, llama3-8b heads on one H200: 0.099 ms against 0.254 with a q head per block)
SHORT_ROWS_TUNING = PrefillTuning(block_m=16, block_n=64, num_warps=4, num_stages=3, pack_gqa=True)
# blocks of 128 rows for long chunks (their keys read half as often as with 64)
LONG_ROWS_TUNING = PrefillTuning(block_m=128, block_n=64, num_warps=8, num_stages=3)


def long_rows_tuning(num_tokens: int, num_seqs: int) -> PrefillTuning:
    """Launch parameters of the sequences of SHORT_ROWS or more new tokens, from shapes only: 128-row blocks from
    1024 new tokens per sequence on average, the fresh kernel's setting below. On one H200
    (benchmarks/probes/paged_prefill_probe.py, llama3-8b heads) a 2048-token chunk after 6144 cached tokens took
    0.875 ms in 128-row blocks against 0.953 in 64-row ones; 16 chunks of 128 after 512 the same in both."""
    return LONG_ROWS_TUNING if num_tokens >= 1024 * max(num_seqs, 1) else DEFAULT_TUNING


def paged_supported(q_MHD: Tensor, k_cache: Tensor) -> bool:
    """Whether paged_prefill takes these inputs: `supported` q, a cache of q's dtype with a contiguous head dim."""
    return supported(q_MHD) and k_cache.dtype == q_MHD.dtype and k_cache.stride(-1) == 1


def paged_prefill(
    q_MHD: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    context_lens: Tensor,
    block_tables: Tensor,
    block_size: int,
    scale: float,
    *,
    tuning: PrefillTuning | None = None,
) -> Tensor:
    """Causal attention of each sequence's new tokens (rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q, at positions
    context_lens[b] - n_b onwards) over its first context_lens[b] positions in the page pool (k_cache / v_cache
    (slots, K, D), slot = block_tables[b, pos // block_size] * block_size + pos % block_size), read in place: no
    gather of the context. Decodes, chunks after cached context and fresh sequences mixed in one step; the new
    tokens' K/V must be in the pool already. (M, H, D) contiguous in q's dtype; CUDA only (`paged_supported`).

    Sequences of fewer than SHORT_ROWS new tokens run in one launch (SHORT_ROWS_TUNING; the blocks a short
    sequence can need, per sequence), the others in a second (long_rows_tuning; a program per block of all the
    tokens, the sequence found by search): which sequence is which is read on the GPU, so each launch covers every
    sequence and skips the other class's (one launch where the shapes say that one class is empty). `tuning`: one
    launch for all."""
    num_tokens, num_heads, head_dim = q_MHD.shape
    num_seqs, num_kv_heads = block_tables.shape[0], k_cache.shape[1]
    assert num_heads % num_kv_heads == 0
    q_MHD = q_MHD if q_MHD.stride(-1) == 1 else q_MHD.contiguous()
    out = torch.empty(q_MHD.shape, dtype=q_MHD.dtype, device=q_MHD.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    cu = cu_seqlens_q if cu_seqlens_q.dtype == torch.int32 else cu_seqlens_q.to(torch.int32)
    ctx = context_lens if context_lens.dtype == torch.int32 else context_lens.to(torch.int32)
    tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    no_bound = 2**31 - 1  # the same every step (Triton compiles a variant per kind of int value)
    # (tuning, min_q, max_q, whether every sequence this launch takes has fewer than SHORT_ROWS new tokens)
    if tuning is not None:
        launches = [(tuning, 0, no_bound, False)]
    elif num_seqs == 1:  # the one sequence's class is known
        short = num_tokens < SHORT_ROWS
        launches = [(SHORT_ROWS_TUNING if short else long_rows_tuning(num_tokens, 1), 0, no_bound, short)]
    else:
        launches = [(SHORT_ROWS_TUNING, 0, SHORT_ROWS, True)]
        if num_tokens >= SHORT_ROWS:  # else no sequence has that many
            launches.append((long_rows_tuning(num_tokens, num_seqs), SHORT_ROWS, no_bound, False))
    group = num_heads // num_kv_heads
    on = pdl.enabled(q_MHD.device)
    for t, min_q, max_q, short in launches:
        block_m = max(t.block_m, triton.next_power_of_2(group)) if t.pack_gqa else t.block_m
        tokens = block_m // group if t.pack_gqa else block_m
        # short sequences: a fixed number of programs each (their blocks), where the general mapping launches one
        # per block of all M tokens, most of them finding a long sequence and returning
        seq_blocks = triton.cdiv(SHORT_ROWS - 1, tokens) if short else 0
        programs = num_seqs * seq_blocks if short else triton.cdiv(num_tokens, tokens) + num_seqs
        _paged_prefill_kernel[(programs, num_kv_heads if t.pack_gqa else num_heads)](
            q_MHD, k_cache, v_cache, out, cu, ctx, tables, num_seqs, min_q, max_q, scale * math.log2(math.e),
            block_size, q_MHD.stride(0), q_MHD.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
            v_cache.stride(1), tables.stride(0), out.stride(0), out.stride(1),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=t.block_n, PACK_GQA=t.pack_gqa,
            SEQ_BLOCKS=seq_blocks, PDL=on, num_warps=t.num_warps, num_stages=t.num_stages, launch_pdl=on,
        )  # fmt: skip
    return out
