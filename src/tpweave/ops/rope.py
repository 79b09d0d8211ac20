"""Rotary position embedding, rotate-half form (HF Llama checkpoints): x (M, X, D) for M tokens of X heads,
rotated by the angles of each token's position. cos_sin (P, D) fp32 holds [cos | sin] of the D/2 angles of
each position; the math is fp32, the result rounded once to x's dtype.

`rotate` is the torch form (the model's own RoPE, CPU paths); `rotate_qk` rotates a step's q and k heads in one
Triton kernel on CUDA (the paged attention op: one launch per layer where Inductor's RoPE takes two). Rotating
inside the decode kernel instead measured slower (benchmarks/results/2026-12-02/probes/
decode-kernel-variants-1xH200.json: 93 vs 70 us at batch 64, context 1024), and, only where it splits the context
with the angles loaded before the PDL wait, no faster at batch 1 (probes/rope-in-decode-probe-1xH200.log).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tpweave.ops import pdl

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def rotate(x_MXD: Tensor, cos_sin_PD: Tensor, positions_M: Tensor) -> Tensor:
    """x rotated by the angles of positions (module doc: layout), in x's dtype."""
    cos, sin = cos_sin_PD[positions_M].unsqueeze(1).chunk(2, dim=-1)  # (M, 1, D/2)
    x1, x2 = x_MXD.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_MXD.dtype)


if triton is not None:

    @triton.jit
    def rotated_heads(x_ptr, stride_xh, heads, head_ok, cs_ptr, pos, stride_cs, HEAD_DIM: tl.constexpr):
        """fp32 (len(heads), HEAD_DIM): rows `heads` of one token's (heads, HEAD_DIM) block at x_ptr, rotated by
        the angles of position `pos`."""
        half: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, HEAD_DIM)
        partner = (d + half) % HEAD_DIM
        sign = tl.where(d < half, -1.0, 1.0)
        x = tl.load(x_ptr + heads[:, None] * stride_xh + d[None, :], mask=head_ok[:, None], other=0.0).to(tl.float32)
        xp = tl.load(x_ptr + heads[:, None] * stride_xh + partner[None, :], mask=head_ok[:, None], other=0.0)
        cos = tl.load(cs_ptr + pos * stride_cs + d % half)
        sin = tl.load(cs_ptr + pos * stride_cs + half + d % half)
        return x * cos[None, :] + sign[None, :] * xp.to(tl.float32) * sin[None, :]

    @triton.jit
    def _rope_qk_kernel(
        q_ptr, k_ptr, qo_ptr, ko_ptr, cs_ptr, pos_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
        stride_qm, stride_qh, stride_km, stride_kh, stride_cs, stride_vm, stride_vh, stride_kcs, stride_kch,
        stride_vcs, stride_vch,
        NUM_Q: tl.constexpr, NUM_K: tl.constexpr, Q_PAD: tl.constexpr, K_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        STORE_KV: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl.wait_and_release(PDL)
        m = tl.program_id(0)
        pos = tl.load(pos_ptr + m)
        d = tl.arange(0, HEAD_DIM)
        hq = tl.arange(0, Q_PAD)
        q = rotated_heads(q_ptr + m * stride_qm, stride_qh, hq, hq < NUM_Q, cs_ptr, pos, stride_cs, HEAD_DIM)
        offs = m * NUM_Q * HEAD_DIM + hq[:, None] * HEAD_DIM + d[None, :]
        tl.store(qo_ptr + offs, q.to(qo_ptr.dtype.element_ty), mask=(hq < NUM_Q)[:, None])
        hk = tl.arange(0, K_PAD)
        k_ok = (hk < NUM_K)[:, None]
        k = rotated_heads(k_ptr + m * stride_km, stride_kh, hk, hk < NUM_K, cs_ptr, pos, stride_cs, HEAD_DIM)
        offs = m * NUM_K * HEAD_DIM + hk[:, None] * HEAD_DIM + d[None, :]
        tl.store(ko_ptr + offs, k.to(ko_ptr.dtype.element_ty), mask=k_ok)
        if STORE_KV:  # the token's K and V into the page pool at its slot
            slot = tl.load(slot_ptr + m).to(tl.int64)
            tl.store(kc_ptr + slot * stride_kcs + hk[:, None] * stride_kch + d[None, :], k.to(kc_ptr.dtype.element_ty),
                     mask=k_ok)  # fmt: skip
            v = tl.load(v_ptr + m * stride_vm + hk[:, None] * stride_vh + d[None, :], mask=k_ok, other=0.0)
            tl.store(vc_ptr + slot * stride_vcs + hk[:, None] * stride_vch + d[None, :], v.to(vc_ptr.dtype.element_ty),
                     mask=k_ok)  # fmt: skip


def rotate_qk(
    q_MHD: Tensor,
    k_MKD: Tensor,
    cos_sin_PD: Tensor,
    positions_M: Tensor,
    *,
    store: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """(rotate(q), rotate(k)), contiguous: one Triton kernel on CUDA (head dim a power of 2, last dims
    contiguous), the torch form elsewhere. With store = (v_MKD, k_cache, v_cache, slot_mapping_M), the rotated k
    and v of token m are also written to the caches (num_slots, K, D) at slot_mapping[m], in the same kernel."""
    d = q_MHD.shape[-1]
    if not (
        triton is not None
        and q_MHD.is_cuda
        and d & (d - 1) == 0
        and q_MHD.stride(-1) == 1
        and k_MKD.stride(-1) == 1
        and cos_sin_PD.stride(-1) == 1
        and (store is None or all(t.stride(-1) == 1 for t in store[:3]))
    ):
        q_out, k_out = rotate(q_MHD, cos_sin_PD, positions_M), rotate(k_MKD, cos_sin_PD, positions_M)
        if store is not None:
            v_MKD, k_cache, v_cache, slots = store
            k_cache.index_copy_(0, slots, k_out.to(k_cache.dtype))
            v_cache.index_copy_(0, slots, v_MKD.to(v_cache.dtype))
        return q_out, k_out
    q_out, k_out = (
        torch.empty(q_MHD.shape, dtype=q_MHD.dtype, device=q_MHD.device),
        torch.empty(k_MKD.shape, dtype=k_MKD.dtype, device=k_MKD.device),
    )
    if q_MHD.shape[0]:
        num_q, num_k = q_MHD.shape[1], k_MKD.shape[1]
        v, kc, vc, slots = store if store is not None else (k_MKD, k_out, k_out, positions_M)  # unread when not storing
        on = pdl.enabled(q_MHD.device)
        _rope_qk_kernel[(q_MHD.shape[0],)](
            q_MHD, k_MKD, q_out, k_out, cos_sin_PD, positions_M, v, kc, vc, slots,
            q_MHD.stride(0), q_MHD.stride(1), k_MKD.stride(0), k_MKD.stride(1), cos_sin_PD.stride(0),
            v.stride(0), v.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
            NUM_Q=num_q, NUM_K=num_k, Q_PAD=triton.next_power_of_2(num_q), K_PAD=triton.next_power_of_2(num_k),
            HEAD_DIM=d, STORE_KV=store is not None, PDL=on, num_warps=4, launch_pdl=on,
        )  # fmt: skip
    return q_out, k_out
