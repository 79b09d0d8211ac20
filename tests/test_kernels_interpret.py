"""tpweave's Triton prefill attention kernels run by Triton's interpreter on the CPU (TRITON_INTERPRET=1: the kernels'
own code over numpy) against the fp32 reference, so CI checks their indexing, masking and launch plans without a GPU.
The interpreter must be on before the kernels are defined, so each test runs its cases in a fresh Python process.
Skipped without triton; CI runs it with the box's Triton (.ci/run). What it cannot check: PDL, speed, and whatever
the compiled code does differently (tests/test_gpu_attention.py checks that on the GPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def _run_in_interpreter(function: str) -> None:
    env = os.environ | {"TRITON_INTERPRET": "1"}
    code = f"import test_kernels_interpret as t; t._read_scalars_by_item(); t.{function}()"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _read_scalars_by_item() -> None:
    """Triton 3.6's interpreter turns a scalar into an int by int(array) on a one-element array of one dimension,
    which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"): a loop bound read from
    memory (`range(0, n)` with n loaded) hits it. This process reads the element instead (array.item())."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:  # another Triton: nothing to adapt
        return

    def _patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = _patch_lang_tensor


def _check_paged_prefill() -> None:
    import torch

    from test_gpu_attention import _paged_case
    from tpweave.ops import attention, flash_prefill

    cases = [
        ([1, 1, 40], [20, 70, 90]),  # decodes and a chunk after cached context: two launches
        ([33], [100]),  # one sequence: one launch
        ([3, 0, 2, 70, 1], [3, 5, 40, 70, 9]),  # short rows of 1-3 tokens, an empty one, a fresh sequence
    ]
    for heads, kv_heads in [(8, 2), (16, 2), (10, 2), (32, 1)]:  # groups of 4, 8, 5 (rows left over), 32 (> 16 rows)
        for q_lens, ctx_lens in cases:
            args = _paged_case(q_lens, ctx_lens, heads=heads, kv_heads=kv_heads, head_dim=32, num_blocks=64,
                               device="cpu", dtype=torch.float16)  # fmt: skip
            q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, _ = args
            k_cache[slots], v_cache[slots] = k_new, v_new
            q = torch.cat([q, k_new, v_new], dim=1)[:, :heads]  # a strided view, as the model's QKV split gives
            ref = attention._paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), cu, ctx, tables,
                                                       bs, 0.2)  # fmt: skip
            for tuning in (None, flash_prefill.PrefillTuning(16, 16, 4, 1)):
                got = flash_prefill.paged_prefill(q, k_cache, v_cache, cu, ctx, tables, bs, 0.2, tuning=tuning)
                torch.testing.assert_close(got.float(), ref, atol=2e-3, rtol=2e-3)


def _check_flash_prefill() -> None:
    import torch

    from tpweave.ops import attention, flash_prefill

    gen = torch.Generator().manual_seed(0)
    for lens, heads, kv_heads in [([5, 0, 40, 17], 8, 2), ([33], 4, 4)]:
        qkv = torch.randn(sum(lens), heads + 2 * kv_heads, 32, generator=gen).half()
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        ref = attention._attention_reference(q.float(), k.float(), v.float(), cu, 0.2)
        got = flash_prefill.flash_prefill(q, k, v, cu, 0.2, tuning=flash_prefill.PrefillTuning(16, 16, 4, 1))
        torch.testing.assert_close(got.float(), ref, atol=2e-3, rtol=2e-3)


def test_paged_prefill_kernel_in_the_interpreter():
    """The paged kernel (GQA packed in short row blocks, one launch per row class) == the per-sequence reference."""
    _run_in_interpreter("_check_paged_prefill")


def test_flash_prefill_kernel_in_the_interpreter():
    """The fresh kernel == the per-sequence reference over packed sequences, an empty one included."""
    _run_in_interpreter("_check_flash_prefill")


def _check_invariant_kernels() -> None:
    import torch

    from test_gpu_attention import _paged_case
    from tpweave.ops import attention, invariant_kernels

    gen = torch.Generator().manual_seed(0)
    # matmul: K not a multiple of BLOCK_K, a transposed weight view, rows past one tile; addmm's epilogue
    a = torch.randn(70, 100, generator=gen).half()
    w = torch.randn(90, 100, generator=gen).half()
    bias = torch.randn(90, generator=gen).half()
    ref = a.float() @ w.float().t()
    torch.testing.assert_close(invariant_kernels.matmul(a, w.t()).float(), ref, atol=2e-2, rtol=2e-3)
    got = invariant_kernels.matmul(a, w.t(), bias, beta=0.5, alpha=2.0).float()
    torch.testing.assert_close(got, 2 * ref + 0.5 * bias.float(), atol=4e-2, rtol=2e-3)
    tiling = invariant_kernels.tiling_for(70, 90, 100)  # one BLOCK_K (the interpreter's dot: below)
    for rows in (slice(0, 1), slice(33, 70)):  # a row alone and in another place: the same bits
        got = invariant_kernels.matmul(a[rows], w.t(), tiling=tiling)
        assert torch.equal(got, invariant_kernels.matmul(a, w.t())[rows])
    # the TMA candidates (zeros past the edges, B as a transposed weight or (K, N), persistent programs walking
    # several tiles each, the epilogue): the pointer kernel's result; inputs the TMA cannot describe (rows of 100
    # halves: 200 bytes, not a multiple of 16) run the pointer kernel
    from dataclasses import replace

    invariant_kernels.num_sms = lambda device: 3  # 3 persistent programs for the 2 x 2 tiles
    a96, w96 = torch.randn(70, 96, generator=gen).half(), torch.randn(88, 96, generator=gen).half()
    cases = ((a96, w96.t(), bias[:88]), (a96, w96.t().contiguous(), bias[:88]), (a, w.t(), bias))
    assert [invariant_kernels._tma_describes(x[33:], b) for x, b, _ in cases] == [True, True, False]
    for x, b, c in cases:
        want = invariant_kernels.matmul(x[33:], b, c, beta=0.5, alpha=2.0, tiling=tiling)
        for t in (replace(tiling, tma=True), replace(tiling, tma=True, persistent=True)):
            assert torch.equal(invariant_kernels.matmul(x, b, tiling=t), invariant_kernels.matmul(x, b, tiling=tiling))
            assert torch.equal(invariant_kernels.matmul(x[33:], b, c, beta=0.5, alpha=2.0, tiling=t), want), t
    # a long K with a short last step, under every launch shape of one BLOCK_K: the same bits (the interpreter's dot
    # is NumPy's over a whole BLOCK_K step; the GPU test compares BLOCK_Ks)
    a, w = torch.randn(130, 8229, generator=gen).half(), torch.randn(40, 8229, generator=gen).half()
    want = invariant_kernels.matmul(a, w.t())
    torch.testing.assert_close(want.float(), a.float() @ w.float().t(), atol=0.3, rtol=2e-3)
    block_k = invariant_kernels.tiling_for(130, 40, 8229).block_k
    for tiling in (t for t in invariant_kernels.TILINGS if t.block_k == block_k):
        for rows in (slice(0, 130), slice(0, 1), slice(64, 130)):
            assert torch.equal(invariant_kernels.matmul(a[rows], w.t(), tiling=tiling), want[rows]), (tiling, rows)
    # the other K steps (the decode sizes' 512-deep ones): the product, and a row's bits alone as among the others
    for tiling in (t for t in invariant_kernels.TILINGS if t.block_k != block_k):
        got = invariant_kernels.matmul(a, w.t(), tiling=tiling)
        torch.testing.assert_close(got.float(), a.float() @ w.float().t(), atol=0.3, rtol=2e-3)
        assert torch.equal(invariant_kernels.matmul(a[64:65], w.t(), tiling=tiling), got[64:65]), tiling
    # the "tp" level's tree product: K in 8 chunks with a short last step each (72 = 64 + 8), a row alone and columns
    # apart from the others, and the ranks' subtrees over a row-parallel K summed in the tree's upper levels: the same
    # bits as the whole tree at TP 2, 4 and 8
    from tpweave.ops.collectives import tree_sum

    a, w = torch.randn(70, 576, generator=gen).half(), torch.randn(576, 96, generator=gen).half()
    whole = invariant_kernels.tree_matmul(a, w, 8)
    assert whole.dtype == torch.float32
    torch.testing.assert_close(whole, a.float() @ w.float(), atol=2e-2, rtol=2e-3)
    assert torch.equal(invariant_kernels.tree_matmul(a[5:6], w, 8), whole[5:6])
    assert torch.equal(invariant_kernels.tree_matmul(a, w[:, 40:], 8), whole[:, 40:])
    for world in (2, 4, 8):
        kc = 576 // world
        parts = [invariant_kernels.tree_matmul(a[:, r * kc : (r + 1) * kc], w[r * kc : (r + 1) * kc], 8 // world)
                 for r in range(world)]  # fmt: skip
        assert torch.equal(tree_sum(parts), whole), world
    # the batched product in one launch: each matrix the pointer kernel's bits for it alone, with strided inputs (a
    # transposed B, every other matrix of A), a broadcast bias, and K padded with zeros (eager attention's
    # probabilities over a batch's padded key length)
    a = torch.randn(6, 40, 70, generator=gen).half()[::2]
    b = torch.randn(3, 24, 70, generator=gen).half().transpose(1, 2)
    bias = torch.randn(1, 40, 24, generator=gen).half()
    got = invariant_kernels.bmm(a, b, bias, beta=0.5, alpha=2.0)
    assert got.shape == (3, 40, 24)
    one = invariant_kernels.SMALL_M_TILING  # bmm_tiling_for(40)'s
    for i in range(3):
        assert torch.equal(got[i], invariant_kernels.matmul(a[i], b[i], bias[0], 0.5, 2.0, tiling=one)), i
    padded_a = torch.cat([a, torch.zeros(3, 40, 30).half()], 2)
    padded_b = torch.cat([b, torch.randn(3, 30, 24, generator=gen).half()], 1)
    for t in (invariant_kernels.bmm_tiling_for(40), invariant_kernels.TINY_M_TILING):
        assert torch.equal(invariant_kernels.bmm(padded_a, padded_b, tiling=t), invariant_kernels.bmm(a, b)), t
    # the grouped product in one launch (a mixture of experts): each group's rows the bits of the matmul of those rows
    # alone (the interpreter's dot sums a K step as NumPy does: one tiling on both sides), and of the tree product's;
    # empty groups, rows past the last group zero; more groups than a program reads at a time (SEQ_BLOCK)
    for sizes in ([0, 20, 1, 40, 0], [1 + i % 2 for i in range(130)]):
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
        a = torch.randn(int(offs[-1]) + 14, 96, generator=gen).half()
        b = torch.randn(len(sizes), 40, 96, generator=gen).half().transpose(1, 2)
        few = len(sizes) < invariant_kernels.SEQ_BLOCK
        one = invariant_kernels.TINY_M_TILING if few else invariant_kernels.SMALL_M_TILING
        got = invariant_kernels.grouped_matmul(a, b, offs, tiling=one)
        tree = invariant_kernels.grouped_matmul(a, b, offs, chunks=8) if few else None
        assert not got[int(offs[-1]) :].any()
        for g, (lo, hi) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist())):
            if hi > lo and (few or g in (0, 127, 128, 129)):
                assert torch.equal(got[lo:hi], invariant_kernels.matmul(a[lo:hi], b[g], tiling=one)), g
                torch.testing.assert_close(got[lo:hi].float(), a[lo:hi].float() @ b[g].float(), atol=2e-2, rtol=2e-3)
            if hi > lo and few:
                assert torch.equal(tree[lo:hi], invariant_kernels.tree_matmul(a[lo:hi], b[g], 8).half()), g
        if few:
            assert not tree[int(offs[-1]) :].any()
    # paged: decodes, a chunk after cached context, a fresh sequence longer than one tile, an empty row
    for heads, kv_heads in [(8, 2), (12, 4), (4, 4)]:  # groups of 4, 3 (padded to 4), 1 (64 tokens a tile)
        q_lens, ctx_lens = [1, 20, 0, 90, 1], [330, 150, 3, 90, 1]  # a decode over 6 key chunks: the merge's 4 and 2
        q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, _ = _paged_case(
            q_lens, ctx_lens, heads=heads, kv_heads=kv_heads, head_dim=32, num_blocks=64, device="cpu",
            dtype=torch.float16)  # fmt: skip
        k_cache[slots], v_cache[slots] = k_new, v_new
        ref = attention._paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), cu, ctx, tables, bs,
                                                   0.2)  # fmt: skip
        paged = dict(context_lens=ctx, block_tables=tables, block_size=bs, scale=0.2)
        got = invariant_kernels.attention(q, k_cache, v_cache, cu, split=False, **paged)
        torch.testing.assert_close(got.float(), ref, atol=2e-3, rtol=2e-3)
        # one program per key chunk, then their merge: the same bits as one program per tile
        assert torch.equal(invariant_kernels.attention(q, k_cache, v_cache, cu, split=True, **paged), got)
        # 64 and 16 rows a product, and sub-tiles sharing a chunk's K/V loads (each its own product over its rows):
        # the same bits as one 64-row product a program
        if heads == 8:
            for rows in (64, 16):
                alone = invariant_kernels.AttentionLaunch(rows=rows)
                one = invariant_kernels.attention(q, k_cache, v_cache, cu, split=False, launch=alone, **paged)
                assert torch.equal(one, got), rows
                for sub, split in ((2, False), (4, False), (4, True)):
                    launch = invariant_kernels.AttentionLaunch(rows=rows, subtiles=sub)
                    got_sub = invariant_kernels.attention(q, k_cache, v_cache, cu, split=split, launch=launch, **paged)
                    assert torch.equal(got_sub, one), (rows, sub, split)
        # int64 offsets and lengths, read as they are; rows padded after the last sequence's come back zero (the
        # output is allocated empty: deterministic mode fills it with NaN first)
        padded_q = torch.cat([q, q[:5]])
        torch.use_deterministic_algorithms(True)
        try:
            for split in (False, True):
                wide = dict(paged, context_lens=ctx.long())
                padded = invariant_kernels.attention(padded_q, k_cache, v_cache, cu.long(), split=split, **wide)
                assert torch.equal(padded[: len(q)], got), split
                assert torch.equal(padded[len(q) :], torch.zeros_like(padded[len(q) :])), split
        finally:
            torch.use_deterministic_algorithms(False)
        # the chunk's last token as a decode of its own (context 150, one new token): its row's bits
        for split in (False, True):
            last = invariant_kernels.attention(
                q[20:21],
                k_cache,
                v_cache,
                cu.new_tensor([0, 1]),
                split=split,
                **(paged | dict(context_lens=ctx[1:2], block_tables=tables[1:2])),
            )
            assert torch.equal(last[0], got[20])
    # more sequences than a program reads at a time (SEQ_BLOCK) while it finds its tile's: 150 decodes and a chunk
    q_lens = [1] * 150 + [20]
    assert len(q_lens) > invariant_kernels.SEQ_BLOCK
    q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, _ = _paged_case(
        q_lens, [2 + i % 7 for i in range(150)] + [30], heads=8, kv_heads=2, head_dim=32, num_blocks=256,
        device="cpu", dtype=torch.float16)  # fmt: skip
    k_cache[slots], v_cache[slots] = k_new, v_new
    ref = attention._paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), cu, ctx, tables, bs, 0.2)
    got = invariant_kernels.attention(q, k_cache, v_cache, cu, context_lens=ctx, block_tables=tables, block_size=bs,
                                      scale=0.2, split=False)  # fmt: skip
    torch.testing.assert_close(got.float(), ref, atol=2e-3, rtol=2e-3)
    # packed: its own K/V
    lens = [5, 0, 70, 17]
    qkv = torch.randn(sum(lens), 8 + 4, 32, generator=gen).half()
    q, k, v = qkv.split([8, 2, 2], dim=1)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    ref = attention._attention_reference(q.float(), k.float(), v.float(), cu, 0.2)
    got = invariant_kernels.attention(q, k, v, cu, scale=0.2, split=False)
    torch.testing.assert_close(got.float(), ref, atol=2e-3, rtol=2e-3)
    assert torch.equal(invariant_kernels.attention(q, k, v, cu, scale=0.2, split=True), got)
    four = invariant_kernels.AttentionLaunch(subtiles=4)
    assert torch.equal(invariant_kernels.attention(q, k, v, cu, scale=0.2, split=False, launch=four), got)
    # fresh sequences' K/V packed, and the same K/V written to a page pool (blocks scattered, random values around
    # them) read through the block tables: the same bits (a model compiled alone reads them packed, the engine from
    # its pool)
    q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, _ = _paged_case(
        lens, lens, heads=8, kv_heads=2, head_dim=32, num_blocks=64, device="cpu", dtype=torch.float16)  # fmt: skip
    k_cache[slots], v_cache[slots] = k_new, v_new
    packed = invariant_kernels.attention(q, k_new, v_new, cu, scale=0.2, split=False)
    for split in (False, True):
        paged = invariant_kernels.attention(q, k_cache, v_cache, cu, context_lens=ctx, block_tables=tables,
                                            block_size=bs, scale=0.2, split=split)  # fmt: skip
        assert torch.equal(paged, packed), split
    # the invariant paged op (RoPE and the KV write inside it) on a step of fresh sequences: read packed (fresh) and
    # through the pool (as beside a sequence with context), the same bits and the same pool
    from tpweave.models.layers import rope_inv_freq
    from tpweave.ops import invariant

    invariant_kernels.attention_supported = lambda q, k: k.dtype == q.dtype  # the interpreter runs CPU tensors
    reads, kernel = [], invariant_kernels.attention
    invariant_kernels.attention = lambda *a, **kw: reads.append(kw.get("block_tables") is None) or kernel(*a, **kw)
    qkv = torch.cat([q, k_new, v_new], dim=1)  # strided views, as the model's QKV split gives
    q, k_new, v_new = qkv.split([8, 2, 2], dim=1)
    angles = torch.outer(torch.arange(128, dtype=torch.float32), rope_inv_freq(32, 500000.0, None))
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.cat([torch.arange(n) for n in lens])
    outs = []
    for fresh in (True, False):
        pool = k_cache.clone(), v_cache.clone()
        out = invariant.invariant_paged_attention(q, k_new, v_new, *pool, slots, cu, ctx, tables, bs, 0.2, cos_sin,
                                                  positions, torch.tensor(fresh))  # fmt: skip
        outs.append((out, *pool))
    assert reads == [True, False], reads  # packed, then through the block tables
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    _check_merge_order()


def _check_merge_order() -> None:
    """The split chunks' merge (_merge_chunks_kernel) folds the states in key order, whatever its unrolling (groups of
    4 and 16 loads, a context past one group) and column split: states whose maxima are all 0 (weights exactly 1) and
    whose values span 2**30 make the fold a plain fp32 sum, whose bits follow its order; chunks past the context (NaN
    here) are not read."""
    import torch

    from tpweave.ops import invariant_kernels as ik

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim = 8, 2, 64
    for chunks, group_loads in ((7, 4), (19, ik.MERGE_GROUP_FEW_ROWS)):
        context = chunks * ik.KV_CHUNK - 10  # the last chunk partly filled
        ws_ml = torch.stack([torch.zeros(chunks + 1, 1, heads), torch.full((chunks + 1, 1, heads), 0.25)], dim=1)
        scale = 2.0 ** torch.randint(0, 30, (chunks + 1, 1, heads, dim), generator=gen)
        ws_acc = torch.randn(chunks + 1, 1, heads, dim, generator=gen) * scale
        ws_ml[chunks], ws_acc[chunks] = float("nan"), float("nan")
        out = torch.empty(1, heads, dim)
        tokens = ik.DECODE_ROWS // 4  # a decode's plan: 4 q heads (GROUP_PAD 4) per kv head
        ik._merge_chunks_kernel[(2, kv_heads, dim // ik.MERGE_COLUMNS)](
            out, ws_ml, ws_acc, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([context], dtype=torch.int32),
            1, 1, out.stride(0), out.stride(1), GROUP=4, GROUP_PAD=4, TOKENS=tokens, HEAD_DIM=dim, CHUNK=ik.KV_CHUNK,
            PAGED=True, SEQ_BLOCK=ik.SEQ_BLOCK, PDL=False, D_BLOCK=ik.MERGE_COLUMNS, GROUP_LOADS=group_loads,
        )  # fmt: skip
        in_order, swapped = torch.zeros(1, heads, dim), torch.zeros(1, heads, dim)
        for c in range(chunks):
            other = c ^ 1 if c < chunks - 1 else c  # neighbours swapped
            in_order, swapped = in_order + ws_acc[c], swapped + ws_acc[other]
        assert not torch.equal(in_order, swapped)  # the values tell the orders apart
        assert torch.equal(out, in_order / (0.25 * chunks)), (chunks, group_loads)


def test_invariant_kernels_in_the_interpreter():
    """The batch-invariant Triton matmul and attention (ops/invariant_kernels.py) == fp32 references, through their
    tiling and masking (K tails, tiles across tokens and GQA rows, chunks of cached context, empty sequences), and a
    row alone == the same row among others; K/V packed == the same K/V through a page pool, the paged op's fresh
    steps included; the split chunks' merge folds in key order; the "tp" level's tree product, its ranks' subtrees ==
    the whole tree."""
    _run_in_interpreter("_check_invariant_kernels")


def _check_argmax() -> None:
    import torch

    from tpweave.ops import argmax

    g = torch.Generator().manual_seed(0)
    argmax.supported = lambda logits: True  # the interpreter runs the kernels on CPU tensors
    argmax.num_sms = lambda device: 132
    checked = 0
    for rows, cols in [(1, 1), (1, 7), (3, 5000), (2, 20000), (1, 70000), (64, 4099), (300, 2100)]:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.randn(rows, cols + 3, generator=g).to(dtype)[:, :cols]  # rows strided past their columns
            x[0, cols // 2] = x[0, -1] = 100  # a tie: the first wins
            if rows > 1:
                x[1] = float("-inf")  # every column -inf: 0
            if rows > 2:
                x[2, cols // 3] = x[2, cols - 1] = float("nan")  # a NaN is the maximum, the first one wins
                x[2, 0] = float("inf")
            if rows > 63:
                x[63, :] = 1.0  # all equal: 0
            out = torch.full((rows,), -1, dtype=torch.int64)
            got = argmax.argmax_rows(x, out=out)
            assert got is out and torch.equal(got, torch.argmax(x, -1)), (rows, cols, dtype, got, torch.argmax(x, -1))
            checked += 1
    assert checked == 21
    for rows, cols, sms in [(1, 128256, 132), (256, 128256, 132), (64, 32000, 132), (1000, 50, 8)]:
        slices, per_slice = argmax.slice_plan(rows, cols, sms)
        assert 1 <= slices <= argmax.MAX_SLICES and (slices - 1) * per_slice < cols <= slices * per_slice
        assert slices == 1 or per_slice % argmax.BLOCK == 0


def test_argmax_kernels_give_torch_argmax():
    """Greedy sampling's argmax (ops/argmax.py) in the interpreter: torch.argmax's index for rows of 1 to 70000
    columns split into 1 to 64 slices, ties (the first wins), NaN (the first NaN wins), rows of -inf, in bf16, fp16
    and fp32, rows strided past their columns."""
    _run_in_interpreter("_check_argmax")
