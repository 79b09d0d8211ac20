"""Causal self-attention over a packed batch, as one opaque op (the passes and Inductor see one node).

q_MHD (tokens, q heads, head dim), k_MKD / v_MKD (tokens, kv heads, head dim); cu_seqlens (B + 1,)
int32 gives sequence boundaries in the packed token dim. GQA: q head h reads kv head h // (H / K).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tpweave.ops import flash_prefill, paged_decode, rope


def _attention_reference(q_MHD: Tensor, k_MKD: Tensor, v_MKD: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    group = q_MHD.shape[1] // k_MKD.shape[1]
    out = q_MHD.new_empty(q_MHD.shape)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        q = q_MHD[start:end].transpose(0, 1)  # (H, L, D)
        k = k_MKD[start:end].transpose(0, 1).repeat_interleave(group, dim=0)
        v = v_MKD[start:end].transpose(0, 1).repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


@torch.library.custom_op("tpweave::attention", mutates_args=())
def attention(q_MHD: Tensor, k_MKD: Tensor, v_MKD: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """Causal attention within each sequence of the packed batch (module docstring: shapes); (M, H, D) in
    q's dtype. ops/flash_prefill.py's kernel on CUDA in fp16/bf16 (FA2 varlen for head dims it does not take), a
    per-sequence reference otherwise."""
    return _causal_attention(q_MHD, k_MKD, v_MKD, cu_seqlens, scale)


def _causal_attention(q_MHD: Tensor, k_MKD: Tensor, v_MKD: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """The attention op's body, for callers already inside an op (no second dispatch)."""
    if flash_prefill.supported(q_MHD):
        return flash_prefill.flash_prefill(q_MHD, k_MKD, v_MKD, cu_seqlens, scale)
    if q_MHD.is_cuda and q_MHD.dtype in (torch.float16, torch.bfloat16):  # e.g. head dims 80 or 96: FA2 varlen
        from torch.nn.attention.varlen import varlen_attn

        num_tokens = q_MHD.shape[0]  # an upper bound of max_seqlen: no host sync, no per-batch recompile
        q, k, v = (t.contiguous() for t in (q_MHD, k_MKD, v_MKD))
        cu = cu_seqlens.to(torch.int32)
        return varlen_attn(q, k, v, cu, cu, num_tokens, num_tokens, scale=scale, window_size=(-1, 0)).contiguous()
    return _attention_reference(q_MHD, k_MKD, v_MKD, cu_seqlens, scale)


@attention.register_fake
def _(q_MHD, k_MKD, v_MKD, cu_seqlens, scale):
    return q_MHD.new_empty(q_MHD.shape)  # contiguous, whatever q's strides


def check_paged_args(op: str, cos_sin: Tensor | None, positions: Tensor | None, fresh: Tensor | None) -> None:
    """The paged attention ops' optional arguments: RoPE's pair together or not at all, `fresh` one bool on the CPU
    (read without a device sync)."""
    if (cos_sin is None) != (positions is None):
        raise ValueError(f"{op}: cos_sin and positions go together (RoPE inside the op) or not at all")
    if fresh is not None and (fresh.device.type != "cpu" or fresh.numel() != 1):
        raise ValueError(f"{op}: fresh must be one bool on the CPU, got {fresh.numel()} on {fresh.device}")


@torch.library.custom_op("tpweave::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention(
    q_MHD: Tensor,
    k_MKD: Tensor,
    v_MKD: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    cu_seqlens_q: Tensor,
    context_lens: Tensor,
    block_tables: Tensor,
    block_size: int,
    scale: float,
    cos_sin: Tensor | None = None,
    positions: Tensor | None = None,
    fresh: Tensor | None = None,
) -> Tensor:
    """Attention of each sequence's new tokens against its whole context in a paged KV cache.

    k_cache/v_cache (num_slots, K, D): the page pool, slot = block * block_size + offset. The new
    tokens' K/V are written at slot_mapping (M,) first. Sequence b has new rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] and context_lens[b] tokens in all (cached + new);
    block_tables (B, max_blocks) lists its blocks. With cos_sin (P, D) and positions (M,), q and k are
    unrotated and RoPE is applied here (ops/rope.py: one kernel for q and k on CUDA). `fresh`, a 0-dim bool
    tensor on the CPU (read without a device sync), says that no sequence has cached context (context_lens
    equal the new tokens' counts): attention then runs over the new K/V alone, with no gather from the pool.
    """
    num_tokens, num_seqs = q_MHD.shape[0], block_tables.shape[0]
    check_paged_args("paged_attention", cos_sin, positions, fresh)
    if paged_decode.supported(q_MHD, k_cache) and num_tokens == num_seqs:
        # one new token per sequence (shapes only, no host sync): KV write and attention in the Triton kernel
        if cos_sin is not None:
            q_MHD, k_MKD = rope.rotate_qk(q_MHD, k_MKD, cos_sin, positions)
        return paged_decode.paged_decode(
            q_MHD, k_MKD, v_MKD, k_cache, v_cache, slot_mapping, block_tables, context_lens, block_size, scale
        )
    if cos_sin is not None:  # RoPE and the KV write in one kernel on CUDA
        q_MHD, k_MKD = rope.rotate_qk(q_MHD, k_MKD, cos_sin, positions, store=(v_MKD, k_cache, v_cache, slot_mapping))
    else:
        k_cache.index_copy_(0, slot_mapping, k_MKD.to(k_cache.dtype))
        v_cache.index_copy_(0, slot_mapping, v_MKD.to(v_cache.dtype))
    if fresh is not None and bool(fresh):
        return _causal_attention(q_MHD, k_MKD, v_MKD, cu_seqlens_q, scale)
    if flash_prefill.paged_supported(q_MHD, k_cache):
        return flash_prefill.paged_prefill(
            q_MHD, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, block_size, scale
        )
    if q_MHD.is_cuda and q_MHD.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q_MHD.dtype:
        # e.g. head dims 80 or 96: the context gathered out of the pool, then FA2 varlen
        return _paged_prefill_cuda(q_MHD, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, block_size, scale)
    return _paged_attention_reference(
        q_MHD, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, block_size, scale
    )


def _paged_attention_reference(q_MHD, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, block_size, scale):
    group = q_MHD.shape[1] // k_cache.shape[1]
    out = q_MHD.new_empty(q_MHD.shape)
    bounds, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        num_q, num_kv = end - start, lens[b]
        if num_q == 0:  # a sequence of a padded step with no tokens (engine/model_runner.py)
            continue
        pos = torch.arange(num_kv, device=q_MHD.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        k = k_cache[slots].transpose(0, 1).repeat_interleave(group, dim=0)  # (H, L, D)
        v = v_cache[slots].transpose(0, 1).repeat_interleave(group, dim=0)
        q = q_MHD[start:end].transpose(0, 1)
        # query i sits at position num_kv - num_q + i and sees keys up to it
        visible = pos[None, :] <= (num_kv - num_q + torch.arange(num_q, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=visible, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def _paged_prefill_cuda(q_MHD, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, block_size, scale):
    """Steps with cached context at head dims the Triton kernel does not take (e.g. 80, 96): pack each sequence's
    context out of the page pool, then FA2 varlen.

    Sizes come from shapes only (no host sync): the packed buffer has B * L + 1 rows for L = the
    block table's span; sequence b's context goes to rows cu_k[b]:cu_k[b+1], the rest of the B x L
    candidates go to the last (scratch) row. Causal masking is aligned bottom-right (FA2), so the
    new queries of a sequence see its cached context.
    """
    from torch.nn.attention.varlen import varlen_attn

    num_seqs, span = block_tables.shape[0], block_tables.shape[1] * block_size
    pos_L = torch.arange(span, device=q_MHD.device)
    slots_BL = block_tables.long()[:, pos_L // block_size] * block_size + pos_L % block_size
    cu_k = torch.zeros(num_seqs + 1, dtype=torch.int32, device=q_MHD.device)
    cu_k[1:] = context_lens.cumsum(0)
    valid_BL = pos_L[None, :] < context_lens[:, None]
    dest_BL = torch.where(valid_BL, cu_k[:-1, None].long() + pos_L[None, :], num_seqs * span)
    packed = []
    for cache in (k_cache, v_cache):
        buf = cache.new_empty(num_seqs * span + 1, *cache.shape[1:])
        buf.index_copy_(0, dest_BL.flatten(), cache[slots_BL.flatten()])
        packed.append(buf)
    out = varlen_attn(
        q_MHD.contiguous(),
        packed[0],
        packed[1],
        cu_seqlens_q.to(torch.int32),
        cu_k,
        q_MHD.shape[0],
        span,
        scale=scale,
        window_size=(-1, 0),
    )
    return out.contiguous()


@paged_attention.register_fake
def _(q_MHD, k_MKD, v_MKD, k_cache, v_cache, slot_mapping, cu_seqlens_q, context_lens, block_tables, block_size, scale,
      cos_sin=None, positions=None, fresh=None):  # fmt: skip
    return q_MHD.new_empty(q_MHD.shape)
