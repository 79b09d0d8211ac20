"""Batch-invariant kernels: each row's result depends on that row's inputs alone, never on how many other rows share
the call or where the row sits among them (CompileOptions(invariant="batch"), compiler/invariant.py swaps them in).

A matmul's result for a row depends on the kernel the library picks, and libraries pick by shape (M rows: a GEMV at
one row, other tilings and K splits at others). Here every matmul runs on row tiles of a fixed shape:

    invariant_mm(a (M, K), b (K, N)):   a padded to whole tiles of ROW_TILE rows, one (ROW_TILE, K) @ (K, N) per tile

so each row always meets the same kernel, with the same reduction order over K (a grouped matmul's groups too:
invariant_grouped_mm). A batched matmul (invariant_bmm: eager attention's scores and values) also walks K in fixed
chunks of BMM_K_CHUNK from index 0: its K may be a key length padded to the batch's longest sequence, whose padding
probabilities are exact zeros, and a chunk of zeros added to the sum changes no bit.

Attention: one query's output is computed the same way whether it is one of many new tokens (prefill, a chunk) or
the only one (decode): its sequence's keys in chunks of KV_CHUNK positions, in order, each chunk's scores and
values through fixed-shape batched matmuls (heads x ROW_TILE queries x KV_CHUNK keys), an online softmax in fp32
merged chunk by chunk. A chunk wholly past a query's position adds exact zeros (its running max and sums unchanged),
so how many chunks its tile walks does not change it. The paged form writes the new K/V into the page pool first and
reads the context from the pool, so a prefill and a later decode read the same stored values (the Triton path reads
a step of fresh sequences' new K/V packed where the pool holds q's dtype: the values stored, in the same chunks).

These are the CPU path, and the CUDA path where ops/invariant_kernels.py's Triton kernels do not take the inputs
(e.g. fp32, a head dim that is not a power of 2). Where they do, Triton launches (one per matmul, one or two per
attention call) with the same guarantees (that module's doc) replace the tile loops.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tpweave.ops import gemv, invariant_kernels, rope
from tpweave.ops.attention import check_paged_args
from tpweave.ops.collectives import all_gather_dim0, shard_rows, tree_sum

ROW_TILE = 16  # rows per matmul call
KV_CHUNK = 64  # key positions per attention step


def _tiles(a: Tensor) -> tuple[Tensor, int]:
    """a (M, K) padded with zero rows to whole tiles, and M."""
    m = a.shape[0]
    pad = -m % ROW_TILE
    return (torch.cat([a, a.new_zeros(pad, a.shape[1])]) if pad else a), m


def _mm(a: Tensor, b: Tensor) -> Tensor:
    if invariant_kernels.mm_supported(a, b):
        return invariant_kernels.matmul(a, b)
    padded, m = _tiles(a.contiguous())
    out = a.new_empty(padded.shape[0], b.shape[1])
    for start in range(0, padded.shape[0], ROW_TILE):
        torch.mm(padded[start : start + ROW_TILE], b, out=out[start : start + ROW_TILE])
    return out[:m]


@torch.library.custom_op("tpweave::invariant_mm", mutates_args=())
def invariant_mm(a: Tensor, b: Tensor) -> Tensor:
    """a (M, K) @ b (K, N), each row through the same fixed-shape tile (module doc)."""
    return _mm(a, b)


@invariant_mm.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("tpweave::invariant_gated_mm", mutates_args=())
def invariant_gated_mm(gu: Tensor, b: Tensor) -> Tensor:
    """silu(gate) * up @ b for gu = [gate | up] (M, 2K), b (K, N) (a SwiGLU MLP's down projection): the activation in
    fp32 rounded once to gu's dtype (gemv.silu_and_mul: on CUDA the default mode's Triton kernel, one at every M),
    then invariant_mm's product."""
    if gu.is_cuda and gu.stride(-1) != 1:
        gu = gu.contiguous()  # silu_and_mul's kernel, not its torch form, whatever the strides
    return _mm(gemv.silu_and_mul(gu), b)


@invariant_gated_mm.register_fake
def _(gu, b):
    return gu.new_empty(gu.shape[0], b.shape[1])


@torch.library.custom_op("tpweave::invariant_addmm", mutates_args=())
def invariant_addmm(bias: Tensor, a: Tensor, b: Tensor, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """beta * bias + alpha * (a @ b), the product as invariant_mm's (elementwise after it: row-invariant)."""
    if invariant_kernels.mm_supported(a, b):
        return invariant_kernels.matmul(a, b, bias, beta, alpha)
    return _scaled_add(_mm(a, b), bias, beta, alpha)


def _scaled_add(product: Tensor, bias: Tensor | None, beta: float, alpha: float) -> Tensor:
    """addmm's epilogue: beta * bias + alpha * product (bias None: alpha * product)."""
    out = product * alpha if alpha != 1.0 else product
    return out if bias is None else out + (bias if beta == 1.0 else beta * bias)


@invariant_addmm.register_fake
def _(bias, a, b, beta=1.0, alpha=1.0):
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("tpweave::invariant_grouped_mm", mutates_args=())
def invariant_grouped_mm(a: Tensor, b: Tensor, offs: Tensor, tree: bool) -> Tensor:
    """A grouped matmul (a mixture of experts' experts): a (S, K), its rows sorted by group; b (G, K, N); offs (G,)
    each group's end row. Group g's rows @ b[g], each as invariant_mm's product (tree=True: tp_invariant_mm's), so a
    row's result does not depend on how many rows its group or the call holds; rows past the last group are zeros.
    (`tree` has no default: Inductor drops an argument passed at its default and then miscounts them.) On CUDA one
    launch without a host sync (invariant_kernels.grouped_matmul), so CUDA graphs capture it."""
    if invariant_kernels.grouped_mm_supported(a, b, offs) and (not tree or a.shape[1] % K_CHUNKS == 0):
        return invariant_kernels.grouped_matmul(a, b, offs, chunks=K_CHUNKS if tree else 0)
    out = a.new_zeros(a.shape[0], b.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):  # one host read, as torch's own fallbacks do
        if end > start:
            rows = a[start:end]
            out[start:end] = _tree_mm(rows, b[g], K_CHUNKS) if tree else _mm(rows, b[g])
        start = end
    return out


@invariant_grouped_mm.register_fake
def _(a, b, offs, tree):
    return a.new_empty(a.shape[0], b.shape[2])


BMM_K_CHUNK = 64  # K per step of a batched matmul's reduction


def _chunked_bmm(a: Tensor, b: Tensor) -> Tensor:
    """a (B, M, K) @ b (B, K, N) in fp32: K zero-padded to whole BMM_K_CHUNK chunks from index 0, each chunk's
    product over fixed (ROW_TILE, BMM_K_CHUNK) x (BMM_K_CHUNK, COL_TILE) tiles (M and N zero-padded to whole tiles),
    the chunks' products added in order. An element's sum is the same whatever B, M, N and however many zeros end K
    (a chunk of zeros adds exact zeros)."""
    nb, m, k = a.shape
    n = b.shape[2]
    pm, pk, pn = -m % ROW_TILE, -k % BMM_K_CHUNK, -n % COL_TILE
    a = torch.nn.functional.pad(a.float(), (0, pk, 0, pm))
    b = torch.nn.functional.pad(b.float(), (0, pn, 0, pk))
    rows, chunks, cols = (m + pm) // ROW_TILE, (k + pk) // BMM_K_CHUNK, (n + pn) // COL_TILE
    a_tiles = a.reshape(nb, rows, ROW_TILE, chunks, BMM_K_CHUNK).permute(3, 0, 1, 2, 4)  # (chunks, B, R, T, C)
    b_tiles = b.reshape(nb, chunks, BMM_K_CHUNK, cols, COL_TILE).permute(1, 0, 3, 2, 4)  # (chunks, B, cols, C, N)
    acc = None
    for c in range(chunks):
        part = torch.matmul(a_tiles[c][:, :, None], b_tiles[c][:, None])  # (B, R, cols, ROW_TILE, COL_TILE)
        acc = part if acc is None else acc + part
    if acc is None:  # K = 0
        return a.new_zeros(nb, m, n)
    return acc.permute(0, 1, 3, 2, 4).reshape(nb, rows * ROW_TILE, cols * COL_TILE)[:, :m, :n]


def _bmm(a: Tensor, b: Tensor, bias: Tensor | None = None, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """alpha * (a @ b) + beta * bias (bias None: the product alone; beta 0: bias not read), batched, in a's dtype."""
    nb, m, _ = a.shape
    n = b.shape[2]
    if bias is not None and beta != 0:
        bias = torch.broadcast_to(bias, (nb, m, n))
    else:
        bias = None
    if nb and invariant_kernels.mm_supported(a[0], b[0]):  # the Triton matmul's K walk, every matrix in one launch
        return invariant_kernels.bmm(a, b, bias, beta, alpha)
    out = _scaled_add(_chunked_bmm(a, b), None if bias is None else bias.float(), beta, alpha)
    return out.to(a.dtype).contiguous()


@torch.library.custom_op("tpweave::invariant_bmm", mutates_args=())
def invariant_bmm(a: Tensor, b: Tensor) -> Tensor:
    """a (B, M, K) @ b (B, K, N): an element's result depends on its row of a and its column of b alone, not on B,
    M, N or zeros appended to K (an attention's probabilities over a right-padded key length: _chunked_bmm's K
    chunks; on CUDA in fp16 / bf16 the Triton matmul over every matrix in one launch, K walked in 16-deep steps in
    order)."""
    return _bmm(a, b)


@invariant_bmm.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], a.shape[1], b.shape[2])


@torch.library.custom_op("tpweave::invariant_baddbmm", mutates_args=())
def invariant_baddbmm(bias: Tensor, a: Tensor, b: Tensor, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """beta * bias + alpha * (a @ b) (bias broadcast to (B, M, N); beta 0: not read), the product as invariant_bmm's
    (the rest elementwise after it, in fp32)."""
    return _bmm(a, b, bias, beta, alpha)


@invariant_baddbmm.register_fake
def _(bias, a, b, beta=1.0, alpha=1.0):
    return a.new_empty(a.shape[0], a.shape[1], b.shape[2])


def _attend(q_nHD: Tensor, pos_n: Tensor, k_LKD: Tensor, v_LKD: Tensor, scale: float) -> Tensor:
    """Queries q (n, H, D) at positions pos (n,) over keys/values (L, K, D) at positions 0..L-1 (a query sees keys
    up to its own position), in q's dtype (module doc: the order of every reduction)."""
    n, num_heads, head_dim = q_nHD.shape
    group = num_heads // k_LKD.shape[1]
    length = k_LKD.shape[0]
    chunks = math.ceil(length / KV_CHUNK)
    pad_l = chunks * KV_CHUNK - length
    k = k_LKD.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
    v = v_LKD.float().repeat_interleave(group, dim=1).transpose(0, 1)
    if pad_l:
        k = torch.cat([k, k.new_zeros(num_heads, pad_l, head_dim)], dim=1)
        v = torch.cat([v, v.new_zeros(num_heads, pad_l, head_dim)], dim=1)
    out = q_nHD.new_empty(q_nHD.shape)
    keys = torch.arange(KV_CHUNK, device=q_nHD.device)
    for start in range(0, n, ROW_TILE):
        rows = min(ROW_TILE, n - start)
        q = q_nHD.new_zeros(ROW_TILE, num_heads, head_dim, dtype=torch.float32)
        q[:rows] = q_nHD[start : start + rows].float()
        q = q.transpose(0, 1)  # (H, T, D)
        pos = torch.zeros(ROW_TILE, dtype=torch.long, device=q.device)  # padding rows see key 0 only
        pos[:rows] = pos_n[start : start + rows]
        m_i = q.new_full((num_heads, ROW_TILE), float("-inf"))
        l_i = q.new_zeros(num_heads, ROW_TILE)
        acc = q.new_zeros(num_heads, ROW_TILE, head_dim)
        for c in range(math.ceil((int(pos.max()) + 1) / KV_CHUNK)):
            kc, vc = k[:, c * KV_CHUNK : (c + 1) * KV_CHUNK], v[:, c * KV_CHUNK : (c + 1) * KV_CHUNK]
            s = torch.bmm(q, kc.transpose(1, 2)) * scale  # (H, T, C)
            s = s.masked_fill((c * KV_CHUNK + keys)[None, :] > pos[:, None], float("-inf"))
            m_new = torch.maximum(m_i, s.amax(-1))
            alpha = torch.exp(m_i - m_new)
            p = torch.exp(s - m_new[..., None])
            l_i = l_i * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.bmm(p, vc)
            m_i = m_new
        out[start : start + rows] = (acc / l_i[..., None]).transpose(0, 1)[:rows].to(out.dtype)
    return out


@torch.library.custom_op("tpweave::invariant_attention", mutates_args=())
def invariant_attention(q_MHD: Tensor, k_MKD: Tensor, v_MKD: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """tpweave::attention's contract (ops/attention.py), batch-invariant (module doc)."""
    if invariant_kernels.attention_supported(q_MHD, k_MKD):
        return invariant_kernels.attention(q_MHD, k_MKD, v_MKD, cu_seqlens, scale=scale)
    out = q_MHD.new_empty(q_MHD.shape)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            pos = torch.arange(end - start, device=q_MHD.device)
            out[start:end] = _attend(q_MHD[start:end], pos, k_MKD[start:end], v_MKD[start:end], scale)
    return out


@invariant_attention.register_fake
def _(q_MHD, k_MKD, v_MKD, cu_seqlens, scale):
    return q_MHD.new_empty(q_MHD.shape)


@torch.library.custom_op("tpweave::invariant_paged_attention", mutates_args=("k_cache", "v_cache"))
def invariant_paged_attention(
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
    """tpweave::paged_attention's contract (ops/attention.py), batch-invariant: the new K/V written to the pool, then
    every sequence's queries over its context. A step of fresh sequences (`fresh`) whose pool holds q's dtype reads
    the new K/V packed, as the step made them: they are the values the pool holds, and the kernel walks packed and
    paged keys in the same tiles and chunks, so a sequence gets the same bits fresh or beside others with context;
    other steps read the pool."""
    check_paged_args("invariant_paged_attention", cos_sin, positions, fresh)
    if invariant_kernels.attention_supported(q_MHD, k_cache):
        if cos_sin is not None:  # RoPE and the KV write in one kernel (row-wise: each token alone)
            q_MHD, k_MKD = rope.rotate_qk(q_MHD, k_MKD, cos_sin, positions, store=(v_MKD, k_cache, v_cache,
                                                                                   slot_mapping))  # fmt: skip
        else:
            k_cache.index_copy_(0, slot_mapping, k_MKD.to(k_cache.dtype))
            v_cache.index_copy_(0, slot_mapping, v_MKD.to(v_cache.dtype))
        if fresh is not None and bool(fresh):  # attention_supported: the pool holds q's dtype
            return invariant_kernels.attention(q_MHD, k_MKD, v_MKD, cu_seqlens_q, scale=scale)
        return invariant_kernels.attention(q_MHD, k_cache, v_cache, cu_seqlens_q, context_lens=context_lens,
                                           block_tables=block_tables, block_size=block_size, scale=scale)  # fmt: skip
    if cos_sin is not None:
        q_MHD, k_MKD = rope.rotate(q_MHD, cos_sin, positions), rope.rotate(k_MKD, cos_sin, positions)
    k_cache.index_copy_(0, slot_mapping, k_MKD.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v_MKD.to(v_cache.dtype))
    out = q_MHD.new_empty(q_MHD.shape)
    bounds, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end == start:
            continue
        num_q, num_kv = end - start, lens[b]
        ctx = torch.arange(num_kv, device=q_MHD.device)
        slots = block_tables[b, ctx // block_size].long() * block_size + ctx % block_size
        pos = torch.arange(num_kv - num_q, num_kv, device=q_MHD.device)
        out[start:end] = _attend(q_MHD[start:end], pos, k_cache[slots].to(q_MHD.dtype),
                                 v_cache[slots].to(q_MHD.dtype), scale)  # fmt: skip
    return out


@invariant_paged_attention.register_fake
def _(q_MHD, k_MKD, v_MKD, k_cache, v_cache, slot_mapping, cu_seqlens_q, context_lens, block_tables, block_size, scale,
      cos_sin=None, positions=None, fresh=None):  # fmt: skip
    return q_MHD.new_empty(q_MHD.shape)


def _as_meta(t: Tensor | None) -> Tensor | None:
    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@torch.library.custom_op("tpweave::invariant_sdpa_cpu", mutates_args=())
def invariant_sdpa_cpu(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """aten._scaled_dot_product_flash_attention_for_cpu's contract (what torch's SDPA becomes on a CPU: query
    (B, H, L, D), key / value (B, H, S, D), an optional boolean or additive mask broadcastable to (B, H, L, S), causal
    from the top left; (output, logsumexp) with the aten op's layouts), batch-invariant: each sequence alone, its
    queries in fixed tiles, its keys in fixed chunks (module doc). A row that sees no key gets zeros."""
    if dropout_p:
        raise ValueError("invariant_sdpa_cpu: dropout is not supported")
    ref_out, ref_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *(_as_meta(t) for t in (query, key, value)), dropout_p, is_causal, attn_mask=_as_meta(attn_mask), scale=scale
    )
    out = torch.empty_strided(ref_out.shape, ref_out.stride(), dtype=query.dtype, device=query.device)
    lse = torch.empty_strided(ref_lse.shape, ref_lse.stride(), dtype=torch.float32, device=query.device)
    num_b, num_heads, length, dim = query.shape
    keys_len = key.shape[2]
    scale = dim**-0.5 if scale is None else scale
    chunks = math.ceil(keys_len / KV_CHUNK)
    cols = torch.arange(chunks * KV_CHUNK, device=query.device)
    mask = None if attn_mask is None else attn_mask.expand(num_b, num_heads, length, keys_len)
    for b in range(num_b):
        k = torch.zeros(num_heads, chunks * KV_CHUNK, dim, dtype=torch.float32, device=query.device)
        v = torch.zeros_like(k)
        k[:, :keys_len], v[:, :keys_len] = key[b].float(), value[b].float()
        for start in range(0, length, ROW_TILE):
            rows = min(ROW_TILE, length - start)
            q = query.new_zeros(num_heads, ROW_TILE, dim, dtype=torch.float32)
            q[:, :rows] = query[b, :, start : start + rows].float()
            bias = q.new_zeros(num_heads, ROW_TILE, chunks * KV_CHUNK)
            bias[..., keys_len:] = float("-inf")
            if mask is not None:
                m = mask[b, :, start : start + rows]
                bias[:, :rows, :keys_len] = (
                    torch.zeros_like(m, dtype=torch.float32).masked_fill(~m, float("-inf")) if m.dtype == torch.bool
                    else m.float()
                )  # fmt: skip
            if is_causal:
                qpos = torch.arange(start, start + ROW_TILE, device=query.device)
                bias = bias.masked_fill(cols[None, None, :] > qpos[None, :, None], float("-inf"))
            m_i = q.new_full((num_heads, ROW_TILE), float("-inf"))
            l_i = q.new_zeros(num_heads, ROW_TILE)
            acc = q.new_zeros(num_heads, ROW_TILE, dim)
            for c in range(chunks):
                cs = slice(c * KV_CHUNK, (c + 1) * KV_CHUNK)
                s = torch.bmm(q, k[:, cs].transpose(1, 2)) * scale + bias[..., cs]
                m_new = torch.maximum(m_i, s.amax(-1))
                safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
                alpha = torch.exp(m_i - safe)
                p = torch.exp(s - safe[..., None])
                l_i = l_i * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + torch.bmm(p, v[:, cs])
                m_i = m_new
            seen = l_i > 0
            o = torch.where(seen[..., None], acc / torch.where(seen, l_i, 1.0)[..., None], 0.0)
            out[b, :, start : start + rows] = o[:, :rows].to(out.dtype)
            lse[b, :, start : start + rows] = torch.where(seen, m_i + torch.log(l_i), float("-inf"))[:, :rows]
    return out, lse


@invariant_sdpa_cpu.register_fake
def _(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return torch.empty_like(out), torch.empty_like(lse)


# The "tp" level: every matmul's K in K_CHUNKS equal chunks, their fp32 products summed in one binary tree
# (collectives.tree_sum). A row-parallel layer at TP = W holds K_CHUNKS / W of the chunks on each rank: it sums its own
# subtree, and the ranks' subtrees are summed in the tree's upper levels, so TP = 1, 2, 4 and 8 give the same bits.
# Columns run in tiles of COL_TILE, so a column's product does not depend on how many columns a rank holds.
K_CHUNKS = 8
COL_TILE = 64


def _tree_mm(a: Tensor, b: Tensor, chunks: int) -> Tensor:
    """a (M, K) @ b (K, N) in fp32, K in `chunks` chunks summed by tree_sum, each chunk's product over fixed
    (ROW_TILE, K / chunks) x (K / chunks, COL_TILE) tiles; on CUDA in fp16 / bf16, ops/invariant_kernels.py's
    tree_matmul (the same tree, its own tiles)."""
    m, k = a.shape
    n = b.shape[1]
    if k % chunks:
        raise ValueError(f"tree matmul: K = {k} is not a multiple of its {chunks} chunks")
    if invariant_kernels.mm_supported(a, b) and chunks in invariant_kernels.TREE_CHUNKS:
        return invariant_kernels.tree_matmul(a, b, chunks)
    kc = k // chunks
    padded, _ = _tiles(a.contiguous())
    pad_n = -n % COL_TILE
    w = b.float()
    if pad_n:
        w = torch.cat([w, w.new_zeros(k, pad_n)], dim=1)
    row_tiles, col_tiles = padded.shape[0] // ROW_TILE, w.shape[1] // COL_TILE
    a_tiles = padded.float().reshape(row_tiles, ROW_TILE, chunks, kc).permute(2, 0, 1, 3).contiguous()
    w_tiles = w.reshape(chunks, kc, col_tiles, COL_TILE).permute(0, 2, 1, 3).contiguous()
    partials = [torch.matmul(a_tiles[c][:, None], w_tiles[c][None]) for c in range(chunks)]  # (R, C, T, COL_TILE)
    out = tree_sum(partials).permute(0, 2, 1, 3).reshape(row_tiles * ROW_TILE, col_tiles * COL_TILE)
    return out[:m, :n].contiguous()  # the ops' fakes are contiguous: N not a multiple of COL_TILE would not be


@torch.library.custom_op("tpweave::tp_invariant_mm", mutates_args=())
def tp_invariant_mm(a: Tensor, b: Tensor) -> Tensor:
    """a (M, K) @ b (K, N) over the "tp" level's K chunks and tiles, in a's dtype."""
    return _tree_mm(a, b, K_CHUNKS).to(a.dtype)


@tp_invariant_mm.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("tpweave::tp_invariant_addmm", mutates_args=())
def tp_invariant_addmm(bias: Tensor, a: Tensor, b: Tensor, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """beta * bias + alpha * (a @ b), the product as tp_invariant_mm's."""
    return _scaled_add(_tree_mm(a, b, K_CHUNKS).to(a.dtype), bias, beta, alpha)


@tp_invariant_addmm.register_fake
def _(bias, a, b, beta=1.0, alpha=1.0):
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("tpweave::tp_invariant_rank_subtree", mutates_args=())
def tp_invariant_rank_subtree(a: Tensor, b: Tensor, world_size: int) -> Tensor:
    """(M, N) fp32: this rank's subtree of a row-parallel product a (M, K / W) @ b (K / W, N), its K_CHUNKS / W chunks
    summed in the TP=1 product's tree (the K_CHUNKS comment); the ranks' subtrees, summed by tree_sum in rank order,
    give the TP=1 product's bits."""
    if K_CHUNKS % world_size:
        raise ValueError(f"the tp level keeps results across TP sizes dividing {K_CHUNKS}, got {world_size}")
    return _tree_mm(a, b, K_CHUNKS // world_size).contiguous()


@tp_invariant_rank_subtree.register_fake
def _(a, b, world_size):
    return a.new_empty(a.shape[0], b.shape[1], dtype=torch.float32)


def _rank_subtrees(a: Tensor, b: Tensor, group_name: str, world_size: int) -> Tensor:
    """(W, M, N) fp32: every rank's subtree of a row-parallel product (tp_invariant_rank_subtree), gathered."""
    return all_gather_dim0(tp_invariant_rank_subtree(a, b, world_size)[None], world_size, group_name)


@torch.library.custom_op("tpweave::tp_invariant_mm_all_reduce", mutates_args=())
def tp_invariant_mm_all_reduce(a: Tensor, b: Tensor, group_name: str, world_size: int) -> Tensor:
    """A row-parallel layer's a (M, K / W) @ b (K / W, N) summed over the ranks, with the bits of the whole product
    at TP = 1 (the K_CHUNKS comment); in a's dtype."""
    parts = _rank_subtrees(a, b, group_name, world_size)
    return tree_sum(list(parts.unbind(0))).to(a.dtype)


@tp_invariant_mm_all_reduce.register_fake
def _(a, b, group_name, world_size):
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("tpweave::tp_invariant_mm_reduce_scatter", mutates_args=())
def tp_invariant_mm_reduce_scatter(a: Tensor, b: Tensor, group_name: str, world_size: int) -> Tensor:
    """tp_invariant_mm_all_reduce's rows of this rank's token shard: (shard_rows(M), N)."""
    m = a.shape[0]
    rows = shard_rows(m, world_size)
    if rows * world_size > m:
        a = torch.cat([a, a.new_zeros(rows * world_size - m, a.shape[1])])
    rank = torch.distributed.get_rank(torch.distributed.distributed_c10d._resolve_process_group(group_name))
    parts = _rank_subtrees(a, b, group_name, world_size)[:, rank * rows : (rank + 1) * rows]
    return tree_sum(list(parts.unbind(0))).to(a.dtype)


@tp_invariant_mm_reduce_scatter.register_fake
def _(a, b, group_name, world_size):
    return a.new_empty(shard_rows(a.shape[0], world_size), b.shape[1])
