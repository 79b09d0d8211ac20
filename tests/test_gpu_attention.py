"""GPU attention paths against the reference: fresh prefill (Triton flash kernel), paged prefill/mixed (the Triton
kernel over the page pool; FA2 over packed context for other head dims), paged decode (Triton, split context), with
GQA and block tables in random order."""

import dataclasses
import functools

import pytest
import torch

from tpweave.ops import attention

pytestmark = pytest.mark.gpu(gpus=1)


def _paged_case(q_lens, ctx_lens, *, heads=16, kv_heads=4, head_dim=128, block_size=16, num_blocks=4096, seed=0,
                device="cuda", dtype=torch.bfloat16):  # fmt: skip
    """(q, k_new, v_new, k_cache, v_cache, slots, cu_seqlens, context_lens, block_tables, block_size, scale): random
    new tokens (their K/V not yet in the pool) of sequences whose blocks are scattered over the pool."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dev, dt = device, dtype
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dev, dt)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dev, dt)
    width = max(-(-c // block_size) for c in ctx_lens)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(ctx_lens), width, dtype=torch.int32)
    slots, used = [], 0
    for b, (nq, nc) in enumerate(zip(q_lens, ctx_lens)):
        nb = -(-nc // block_size)
        tables[b, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
        slots += [int(tables[b, p // block_size]) * block_size + p % block_size for p in range(nc - nq, nc)]
    m = sum(q_lens)
    q = torch.randn(m, heads, head_dim, generator=gen).to(dev, dt)
    k_new = torch.randn(m, kv_heads, head_dim, generator=gen).to(dev, dt)
    v_new = torch.randn(m, kv_heads, head_dim, generator=gen).to(dev, dt)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
    return (
        q,
        k_new,
        v_new,
        k_cache,
        v_cache,
        torch.tensor(slots, device=dev),
        cu,
        torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
        tables.to(dev),
        block_size,
        head_dim**-0.5,
    )


@pytest.mark.parametrize(
    "q_lens,ctx_lens",
    [
        ([1], [1]),
        ([1], [3000]),  # batch 1, long context: split across programs
        ([1] * 64, [17 + 31 * i for i in range(64)]),  # decode batch, ragged contexts
        ([37, 1, 300], [37, 900, 812]),  # fresh prefill, decode and a chunk after cached context
        ([2048], [2048]),
        ([513, 1], [1537, 5]),
    ],
)
def test_paged_attention_matches_reference(q_lens, ctx_lens):
    args = _paged_case(q_lens, ctx_lens)
    q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, scale = args
    got = torch.ops.tpweave.paged_attention(q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, scale)
    ref = attention._paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), cu, ctx, tables, bs, scale)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    # the new tokens' K/V landed in the cache
    torch.testing.assert_close(k_cache[slots], k_new)


@pytest.mark.parametrize("q_lens", [[2048], [100], [1], [37, 1, 300], [5, 2048]])
@pytest.mark.parametrize("kv_heads", [4, 16])
def test_fresh_paged_attention_matches_reference(q_lens, kv_heads):
    """fresh=True (no cached context): FA2 varlen over the new K/V
    alone; the same as the reference over the cache, and the K/V written to it."""
    q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, scale = _paged_case(
        q_lens, q_lens, kv_heads=kv_heads
    )
    fresh = torch.tensor(True)
    got = torch.ops.tpweave.paged_attention(q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, scale,
                                            None, None, fresh)  # fmt: skip
    ref = attention._paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), cu, ctx, tables, bs, scale)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k_cache[slots], k_new)
    torch.testing.assert_close(v_cache[slots], v_new)
    with pytest.raises(ValueError, match="fresh must be one bool on the CPU"):
        torch.ops.tpweave.paged_attention(q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, scale,
                                          None, None, fresh.cuda())  # fmt: skip


def _cos_sin(head_dim: int, positions: int = 16384) -> torch.Tensor:
    from tpweave.models.layers import rope_inv_freq

    angles = torch.outer(torch.arange(positions, dtype=torch.float32), rope_inv_freq(head_dim, 500000.0, None))
    return torch.cat([angles.cos(), angles.sin()], dim=-1).cuda()


@pytest.mark.parametrize(
    "q_lens,ctx_lens",
    [
        ([1], [3000]),
        ([1] * 64, [17 + 31 * i for i in range(64)]),
        ([37, 1, 300], [37, 900, 812]),
        ([37, 300], [37, 300]),  # fresh: RoPE and the KV write in one kernel, then the flash prefill kernel
        ([2048], [2048]),
    ],
)
def test_paged_attention_with_rope_inside_equals_rope_then_attention(q_lens, ctx_lens):
    """RoPE inside the op (rope_qk's one kernel for q and k, which also writes K/V to the cache outside decode) ==
    ops/rope.py's torch form applied first: the same rotated K and the same V in the cache and output, within bf16
    rounding. q, k and v are views of one fused QKV tensor, as the model passes them."""
    from tpweave.ops import rope

    q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, scale = _paged_case(q_lens, ctx_lens)
    q, k_new, v_new = torch.cat([q, k_new, v_new], dim=1).split([q.shape[1], k_new.shape[1], v_new.shape[1]], dim=1)
    fresh = torch.tensor(q_lens == ctx_lens)
    cos_sin = _cos_sin(q.shape[-1])
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(q_lens, ctx_lens)]).cuda()
    k_cache2, v_cache2 = k_cache.clone(), v_cache.clone()
    got = torch.ops.tpweave.paged_attention(
        q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, scale, cos_sin, positions, fresh
    )
    q_rot, k_rot = rope.rotate(q, cos_sin, positions), rope.rotate(k_new, cos_sin, positions)
    want = torch.ops.tpweave.paged_attention(q_rot, k_rot, v_new, k_cache2, v_cache2, slots, cu, ctx, tables, bs, scale)
    # rounded to bf16 once, as rope.rotate does (a fused multiply-add may round the fp32 sum differently: 1 ulp)
    one_ulp = dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(k_cache[slots], k_rot, **one_ulp)
    assert torch.equal(v_cache[slots], v_new)
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(k_cache[untouched], k_cache2[untouched]) and torch.equal(v_cache[untouched], v_cache2[untouched])
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    q2, k2 = rope.rotate_qk(q, k_new, cos_sin, positions)
    torch.testing.assert_close(q2, q_rot, **one_ulp)
    torch.testing.assert_close(k2, k_rot, **one_ulp)


def test_decode_kernel_is_cuda_graph_safe():
    args = _paged_case([1] * 8, [100 * (i + 1) for i in range(8)])
    q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, scale = args
    run = functools.partial(
        torch.ops.tpweave.paged_attention, q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, scale
    )
    eager = run()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = run()
    # metadata updated in place, as the engine does between replays: one token less of context, the new
    # token's slot that of the last position
    ctx.copy_(ctx - 1)
    pos = ctx.long() - 1
    slots.copy_(tables.gather(1, (pos // bs)[:, None]).squeeze(1).long() * bs + pos % bs)
    graph.replay()
    ref = attention._paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), cu, ctx, tables, bs, scale)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert not torch.equal(out, eager)


def test_varlen_prefill_matches_reference():
    gen = torch.Generator(device="cpu").manual_seed(1)
    lens = [5, 1000, 77]
    m = sum(lens)
    q = torch.randn(m, 16, 128, generator=gen).cuda().bfloat16()
    k = torch.randn(m, 4, 128, generator=gen).cuda().bfloat16()
    v = torch.randn(m, 4, 128, generator=gen).cuda().bfloat16()
    cu = torch.tensor([0, 5, 1005, 1082], dtype=torch.int32, device="cuda")
    got = torch.ops.tpweave.attention(q, k, v, cu, 128**-0.5)
    ref = attention._attention_reference(q.float(), k.float(), v.float(), cu, 128**-0.5)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("lens", [[2048], [1, 7, 300, 129, 1000], [17] * 40, [0, 5, 0, 130, 0], [4096, 3]])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (16, 16, 64), (8, 1, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_prefill_matches_reference(lens, heads, kv_heads, head_dim, dtype):
    """ops/flash_prefill.py's kernel == the per-sequence reference in fp32 over packed sequences of any length
    (empty ones included), GQA groups of 1-8, q/k/v as strided views of one fused QKV tensor."""
    from tpweave.ops import flash_prefill

    gen = torch.Generator(device="cpu").manual_seed(len(lens) + heads)
    m = sum(lens)
    qkv = torch.randn(m, heads + 2 * kv_heads, head_dim, generator=gen).to("cuda", dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    got = flash_prefill.flash_prefill(q, k, v, cu, head_dim**-0.5)
    ref = attention._attention_reference(q.float(), k.float(), v.float(), cu, head_dim**-0.5)
    assert got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


def test_attention_op_takes_head_dims_the_triton_kernel_does_not():
    """A head dim that is no power of 2 (80, 96: Phi-style models) goes to FA2 varlen, same numbers as the
    reference."""
    from tpweave.ops import flash_prefill

    gen = torch.Generator(device="cpu").manual_seed(3)
    for head_dim in (80, 96):
        q = torch.randn(300, 8, head_dim, generator=gen).cuda().bfloat16()
        k, v = (torch.randn(300, 2, head_dim, generator=gen).cuda().bfloat16() for _ in range(2))
        cu = torch.tensor([0, 7, 300], dtype=torch.int32, device="cuda")
        assert not flash_prefill.supported(q)
        got = torch.ops.tpweave.attention(q, k, v, cu, head_dim**-0.5)
        ref = attention._attention_reference(q.float(), k.float(), v.float(), cu, head_dim**-0.5)
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    # the paged op too: decodes and a chunk after cached context, through the gathered context and FA2
    for head_dim in (80, 96):
        args = _paged_case([1, 1, 200], [50, 700, 1200], heads=8, kv_heads=2, head_dim=head_dim)
        q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, scale = args
        got = torch.ops.tpweave.paged_attention(q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, scale)
        ref = attention._paged_attention_reference(
            q.float(), k_cache.float(), v_cache.float(), cu, ctx, tables, bs, scale
        )
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "q_lens,ctx_lens",
    [
        ([1] * 64, [17 + 31 * i for i in range(64)]),  # decodes only: 16-row blocks
        ([1] * 40 + [2000], [1024] * 40 + [4048]),  # decodes mixed with a long chunk after cached context
        ([37, 1, 300, 0], [37, 900, 812, 5]),  # fresh, decode, chunk, a sequence with no new token
        ([64, 65, 63], [64, 1089, 127]),  # chunks at and around block boundaries
        ([2048], [2048]),  # fresh, read back from the pool
        ([5] * 30, [1500] * 30),  # short chunks after long context (e.g. speculative tokens)
    ],
)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(32, 8, 128, 16), (8, 8, 64, 32), (16, 2, 256, 16)])
def test_paged_prefill_matches_reference(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size):
    """ops/flash_prefill.py's paged kernel (keys read in place from the page pool through the block table) == the
    per-sequence reference in fp32, with each of its row blocks (16 with and without GQA packing, 64, 128) and the
    two-launch plan (None) on every case, q a strided view of a fused QKV tensor."""
    from tpweave.ops import flash_prefill

    args = _paged_case(q_lens, ctx_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, scale = args
    k_cache[slots], v_cache[slots] = k_new, v_new
    q = torch.cat([q, k_new, v_new], dim=1)[:, :heads]
    ref = attention._paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), cu, ctx, tables, bs, scale)
    tunings = [flash_prefill.SHORT_ROWS_TUNING, dataclasses.replace(flash_prefill.SHORT_ROWS_TUNING, pack_gqa=False)]
    for tuning in [*tunings, flash_prefill.DEFAULT_TUNING, flash_prefill.LONG_ROWS_TUNING, None]:
        got = flash_prefill.paged_prefill(q, k_cache, v_cache, cu, ctx, tables, bs, scale, tuning=tuning)
        assert got.is_contiguous()
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


def test_prefill_kernels_compile_once_whatever_the_number_of_sequences():
    """The number of sequences changes every step: each prefill kernel keeps one compiled variant per launch setting
    across 1 (fresh kernel; the paged one launches differently for one sequence), 2, 7 and 16 sequences (Triton
    specializes an int argument on == 1 and on divisibility by 16 unless told not to), so serving never stops to
    compile a new one mid-run."""
    import triton

    from tpweave.ops import flash_prefill

    def variants(kernel):
        return len(kernel.device_caches[triton.runtime.driver.active.get_current_device()][0])

    fresh, paged = flash_prefill._flash_prefill_kernel, flash_prefill._paged_prefill_kernel
    counts = []
    for num_seqs in (1, 2, 7, 16):
        lens = [33] * num_seqs
        qkv = torch.randn(sum(lens), 48, 128, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.split([32, 8, 8], dim=1)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        flash_prefill.flash_prefill(q, k, v, cu, 128**-0.5)
        if num_seqs == 1:
            after_one = variants(fresh)
            continue
        args = _paged_case([33] * num_seqs, [100] * num_seqs, heads=32, kv_heads=8)
        q, _, _, k_cache, v_cache, _, cu, ctx, tables, bs, scale = args
        flash_prefill.paged_prefill(q, k_cache, v_cache, cu, ctx, tables, bs, scale)
        counts.append((variants(fresh), variants(paged)))
    assert counts[0] == counts[1] == counts[2], counts
    assert counts[0][0] == after_one, "the fresh kernel compiled another variant for two sequences than for one"
