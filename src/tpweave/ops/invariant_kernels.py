"""Triton kernels for the batch-invariant ops on CUDA (ops/invariant.py dispatches to them where `mm_supported` /
`attention_supported` say so): one launch per matmul, one or two per attention call, no host sync, so CUDA graphs
capture them.

Matmul, C (M, N) = A (M, K) @ B (K, N): a program owns one (BLOCK_M, BLOCK_N) tile of C and walks K in BLOCK_K steps,
in order, accumulating in fp32 (tl.dot into the accumulator). No split-K, no stream-K: an element of C is reduced
the same way whatever M is and wherever its row sits. The launch shape (tile size, warps, stages) changes with M
(`tiling_for`), which changes where an element is computed, not how. (A fixed split of K into chunks added in order
would let decode sizes run split-K with the same bits at every M, but the chunk boundaries stall the pipeline at
every M: 11-24% slower at 2048 rows on one H200, and the split kernels were no faster at one row.) The same tiles and
K walk with A and B loaded by the TMA (`_invariant_matmul_tma_kernel`: one tile a program, or persistent programs)
issue the same warpgroup MMA instructions in the same order (`tiling_for` picks them from 17 rows up).

The "tp" level's tree product (`tree_matmul`, ops/invariant.py K_CHUNKS): the same walk over each of K's 1, 2, 4 or 8
equal chunks into an fp32 tile of its own, the chunks' tiles summed pairwise in the program, neighbours first, and
one launch shape at every shape: a rank's product over its chunks of a row-parallel K is the whole product's
subtree over them.

A grouped product (`grouped_matmul`: a mixture of experts' experts, rows sorted by expert) runs the same K walk, or the
tree's, over each group's row tiles counted from the group's first row, in one launch with no host read: a program
finds its group from the offsets as attention finds a tile's sequence (below), so CUDA graphs capture it.

Attention, over a paged pool or a packed batch: a program owns one kv head and a tile of TOKENS consecutive new
tokens of one sequence, their GROUP q heads as rows ((TOKENS x GROUP_PAD) = ROWS rows: 64 for prefills, 16 for decodes,
`launch_for`). It walks the keys in chunks of KV_CHUNK absolute positions (0..63, 64..127, ...) up to the tile's last
query position. Each chunk's softmax state is computed on its own (scores through tl.dot, a causal mask, the chunk's
max and exp in fp32; the exps' sum and the exp-weighted values through tl.dot, so that no sum's order follows the
tile's rows or warps) and merged into the row's running state in key order (_merge_state). A chunk wholly past a row's
position has the empty state, whose merge changes nothing, so a row's result does not depend on which tile it is in,
how many tokens or rows the tile holds, or whether the step is a prefill, a chunk or a decode. Where (tiles x kv
heads) programs would not fill the GPU (decodes of few sequences), one program per (tile, kv head, chunk) writes its
chunk's state and a second kernel merges them in the same order: the same bits, more programs.

Tiles without a host sync and without a launch of their own: sequence b's new tokens take cdiv(q_len_b, TOKENS) tiles;
the grid has the upper bound cdiv(M, TOKENS) + B programs per kv head, and a program finds its sequence by counting
the tiles of the sequences before it from cu_seqlens itself (_seq_of_tile); those past the last tile exit, but the
first of them zeroes the rows after the last sequence's (padding), so the output needs no memset. A plan computed by
torch ops instead costs 13 small kernels per call, one call per layer: 416 of the 742 kernels of a llama3-8b decode
step at batch 1 (benchmarks/results/2026-12-05/engine-llama3-8b-tp1-1xH200-ak-invariant.json).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from tpweave.ops import pdl
from tpweave.ops.device import num_sms

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: ops/invariant.py's reference path
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # no Triton, or one without host-side TMA descriptors: the pointer kernel
    TensorDescriptor = None

KV_CHUNK = 64  # key positions per attention step (ops/invariant.py's CPU path walks the same chunks)
ATTENTION_ROWS = 64  # query rows (tokens x padded q heads of one kv head) per attention program: one wgmma's M
DECODE_ROWS = 16  # the same where a call's sequences hold few new tokens each: one mma.sync's M
SPLIT_BELOW_PROGRAMS = 264  # one program per key chunk where (tiles x kv heads) programs would not fill the GPU
SEQ_BLOCK = 128  # sequences a program reads at a time while it finds its tile's sequence
MERGE_COLUMNS = 32  # head dims per program of the split chunks' merge (head_dim / 32 programs per tile and kv head)
# chunks' states the merge loads before it folds them: a decode's few programs wait one memory latency per group
# (16: a 16-row tile's 32 columns of a state are 4 registers a thread; 4 where a tile has more rows)
MERGE_GROUP_FEW_ROWS = 16
# registers per thread of the 16-row plan: 4 programs of 4 warps an SM (ptxas takes 148 for llama3-8b's heads: 3;
# 113 before the exps' sums moved to the tensor cores), so that a decode of 64 sequences (512 programs at 8 kv heads)
# runs in one wave of 132 SMs, not 1.3. Only where ptxas fits the plan in them without spills (`_capped`): head dims
# to 64; 128 at 2 to 8 q heads a kv head (1 and 16 spill; at 256 the K/V stages' shared memory allows 2 programs an
# SM anyway)
DECODE_REGISTERS = 128


def _capped(group_pad: int, head_dim: int) -> bool:
    return head_dim <= 64 or (head_dim <= 128 and 2 <= group_pad <= 8)


@dataclass(frozen=True)
class AttentionLaunch:
    """The attention kernel's query rows per product (tokens x padded q heads of one kv head: wgmma from 64 rows,
    mma.sync below), products per program (`subtiles`: 1, 2 or 4, each over its own rows, all sharing each chunk's
    K/V loads), warps, pipeline depth and registers per thread (None: as many as ptxas uses). None of them changes
    a row's bits (`_chunk_values`)."""

    num_warps: int = 4
    num_stages: int = 2
    rows: int = ATTENTION_ROWS
    subtiles: int = 1
    max_registers: int | None = None


def launch_for(num_tokens: int, num_seqs: int, group_pad: int, head_dim: int = 128) -> AttentionLaunch:
    """The default plan for a call of these shapes (shapes only: a CUDA graph's bucket fixes it): ATTENTION_ROWS rows
    a product where the call's sequences average a tile's new tokens or more (a prefill); else DECODE_ROWS (decodes,
    alone or with a chunk: a decode's tile holds one token, 4x fewer padding rows). llama3-8b's heads, a layer at a
    decode of 256 sequences (context 1024): 0.257 ms at 16 rows against 0.414 at 64 on one H200, 0.383 against 0.446
    on one H100; at a 2048-token prefill 0.226 ms at 64 rows against 0.366 at 16 (H200); sub-tiles and 8 warps no
    faster (benchmarks/results/2026-12-05/probes/invariant_attention_probe-llama3-8b-1xH200-fbd82c2.json, before the
    exps' sums moved to the tensor cores, and -1xH100-3bc1382.json, after). The decodes' plan runs in
    DECODE_REGISTERS where it fits them (`_capped`; not yet timed on a GPU)."""
    if num_tokens >= max(1, ATTENTION_ROWS // group_pad) * num_seqs:
        return AttentionLaunch()
    cap = DECODE_REGISTERS if _capped(group_pad, head_dim) else None
    return AttentionLaunch(rows=max(DECODE_ROWS, group_pad), max_registers=cap)


@dataclass(frozen=True)
class MatmulTiling:
    """A launch shape of the invariant matmul. An element's reduction order is the tensor cores' 16-deep steps over K,
    in order, into one fp32 accumulator: BLOCK_K only groups those steps, and block_m / block_n / warps / stages shape
    the launch. One H200 gave the same bits with every tiling tried, BLOCK_K 64 and 128 included
    (benchmarks/probes/invariant_mm_probe.py); tests/test_invariant.py checks rows across the switches on the GPU."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 6
    group_m: int = 8  # programs of GROUP_M row tiles walk the same columns together (L2 reuse; no effect on results)
    # A and B through the TMA (inputs it cannot describe run the pointer kernel); persistent: at most one program
    # per SM, walking the tiles; warp_specialize: Triton's producer / consumer warps over the persistent loop
    tma: bool = False
    persistent: bool = False
    warp_specialize: bool = False


# The pointer kernel's launch shapes (the TMA kernel's too, below), which the probe times
# (benchmarks/probes/invariant_mm_probe.py): 64 x 64 and 64 x 32 with 128-deep K steps for decode sizes; at 16 rows
# (mma.sync instead of wgmma: the same bits, the GPU test) 16 x 16 tiles of 512-deep K steps on 2 warps, which keep
# the most weight bytes in flight per SM; 128 x 64, 64 x 128, 128 x 128 and 128 x 256.
SMALL_M_TILING = MatmulTiling()
SMALL_M_LONG_K_TILING = MatmulTiling(block_n=32, block_k=128, num_stages=5)
TINY_M_TILING = MatmulTiling(block_m=16, block_n=16, block_k=512, num_warps=2, num_stages=3)
TINY_M_NARROW_TILING = replace(TINY_M_TILING, block_n=32)  # 17 to 32 rows of a narrow product
MID_M_TILING = MatmulTiling(block_m=128, num_stages=4)
WIDE_SMALL_M_TILING = MatmulTiling(block_n=128, num_stages=5)
LARGE_M_TILING = MatmulTiling(block_m=128, block_n=128, num_warps=8, num_stages=3)
LARGE_M_WIDE_TILING = MatmulTiling(block_m=128, block_n=256, num_warps=8, num_stages=3)
TILINGS = (SMALL_M_TILING, SMALL_M_LONG_K_TILING, TINY_M_TILING, TINY_M_NARROW_TILING, MID_M_TILING, LARGE_M_TILING,
           LARGE_M_WIDE_TILING)  # fmt: skip
# Through the TMA (from 64 rows: wgmma's): the 64- and 128-row tilings above and 64 x 128, one tile per program and
# persistent; the large ones with warp specialization; a deeper 128 x 256; and 16-column tiles that give a decode's
# narrow products 4x the programs.
TMA_TILINGS = (
    *(
        replace(t, tma=True, persistent=p)
        for t in (*TILINGS, WIDE_SMALL_M_TILING)
        if t.block_m >= 64
        for p in (False, True)
    ),
    *(replace(t, tma=True, persistent=True, warp_specialize=True) for t in (LARGE_M_TILING, LARGE_M_WIDE_TILING)),
    replace(LARGE_M_WIDE_TILING, num_stages=4, tma=True, persistent=True),
    MatmulTiling(block_n=16, block_k=128, num_stages=8, tma=True),
)
# The "tp" level's tree product (`tree_matmul`): one launch shape at every M, N and K. At 8 chunks a program holds
# four fp32 tiles (the tree's pending sums and the chunk's product): 8 warps, where 4 spilled hundreds of registers
# (ptxas for sm_90a; not timed)
TREE_TILING = MatmulTiling(num_warps=8, num_stages=3)
TREE_CHUNKS = (1, 2, 4, 8)
LONG_K = 8192
NARROW_N = 4096
WIDE_N = 8192


def _tma(t: MatmulTiling, *, persistent: bool = False, warp_specialize: bool = False, **over) -> MatmulTiling:
    return replace(t, tma=True, persistent=persistent or warp_specialize, warp_specialize=warp_specialize, **over)


def tiling_for(m: int, n: int = 0, k: int = 0) -> MatmulTiling:
    """The launch shape for an (M, K) x (K, N) product (shapes only: a CUDA graph's bucket fixes it); any gives the
    same bits. The fastest per class of M, N and K in the probe's graph-replayed timings (llama3-8b's four products;
    to 512 rows and at 2048 on one H200, benchmarks/results/2026-12-05/probes/
    invariant_mm_probe-llama3-8b-1xH200-fbd82c2.json; from 512 to 1024 on one H100, -mid-m-llama3-8b-1xH100-bc5969e;
    to 64 rows on one H100, -tiny-m-llama3-8b-1xH100-7c75c10 and -6b3d5a0, lm_head's product too). To 64 rows the
    weights' bytes bound it: many narrow tiles (to 16 rows 16 x 16 with 512-deep K steps, 6-13% faster than 16 x 32
    or 16 x 64 on all but the QKV product, equal there; to 32 rows of a narrow product (N <= 4096, or a long K)
    16 x 32 with 512-deep steps, 35-40% faster than 64-row tiles at 17 rows; else 64 rows, 32 columns with 128-deep K
    steps where 64 would give too few programs). To 512 rows, through the TMA, the tile that
    fills the SMs without leaving them idle: 64 x 64, 64 x 128 or 128 x 64, and 128 x 256 persistent for products of
    many columns. Then the tensor cores bound it: 128 x 256, persistent to 1024 rows, with warp specialization
    above (within 2% of cuBLAS at 2048 rows)."""
    wide = n > WIDE_N
    narrow = k >= LONG_K or n <= NARROW_N
    if m <= 16:
        return TINY_M_TILING
    if m <= 32 and narrow and not wide:
        return TINY_M_NARROW_TILING
    if m <= 64:
        if wide:
            return _tma(WIDE_SMALL_M_TILING)
        return _tma(SMALL_M_LONG_K_TILING if narrow else SMALL_M_TILING)
    if m > 1024:
        return _tma(LARGE_M_WIDE_TILING, warp_specialize=True)
    if wide or m > 512:
        return _tma(LARGE_M_WIDE_TILING, persistent=True, num_stages=4)
    if m <= 128:
        return _tma(SMALL_M_TILING)
    if m <= 256:
        if k >= LONG_K:
            return _tma(SMALL_M_TILING)
        return _tma(WIDE_SMALL_M_TILING if n <= NARROW_N else MID_M_TILING)
    if narrow:
        return _tma(MID_M_TILING)
    return _tma(LARGE_M_WIDE_TILING, persistent=True, num_stages=4)


_DTYPES = (torch.float16, torch.bfloat16)


def mm_supported(a: Tensor, b: Tensor) -> bool:
    """Whether the Triton matmul takes a @ b: CUDA, fp16/bf16 of one dtype, 2-D."""
    return triton is not None and a.is_cuda and a.dtype in _DTYPES and b.dtype == a.dtype and a.dim() == b.dim() == 2


def grouped_mm_supported(a: Tensor, b: Tensor, offs: Tensor) -> bool:
    """Whether grouped_matmul takes a (S, K), b (G, K, N) and offs (G,): CUDA, fp16/bf16 of one dtype, integer offs."""
    return (
        triton is not None
        and a.is_cuda
        and offs.is_cuda
        and a.dtype in _DTYPES
        and b.dtype == a.dtype
        and a.dim() == 2
        and b.dim() == 3
        and offs.dim() == 1
        and not offs.is_floating_point()
    )


def attention_supported(q_MHD: Tensor, k: Tensor) -> bool:
    """Whether the Triton attention takes these inputs: CUDA, fp16/bf16 q and K/V of its dtype, a head dim that is a
    power of 2 >= 16, at most ATTENTION_ROWS q heads per kv head."""
    d = q_MHD.shape[-1]
    return (
        triton is not None
        and q_MHD.is_cuda
        and q_MHD.dtype in _DTYPES
        and k.dtype == q_MHD.dtype
        and d >= 16
        and d & (d - 1) == 0
        and q_MHD.shape[1] // k.shape[1] <= ATTENTION_ROWS
    )


if triton is not None:

    @triton.jit
    def _grouped_tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(first row, first column) of C's tile number `tile`: GROUP_M row tiles walk the same columns together."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % rows_in_group
        pid_n = (tile % per_group) // rows_in_group
        return pid_m * BLOCK_M, pid_n * BLOCK_N

    @triton.jit
    def _tile_of_program(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """The rows and columns of C this program owns (_grouped_tile)."""
        m0, n0 = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        return m0 + tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N)

    @triton.jit
    def _matmul_epilogue(acc, c_ptr, bias_ptr, rm, rn, M, N, stride_cm, stride_cn, stride_bias_m, stride_bias_n, beta,
                         alpha, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr):  # fmt: skip
        """C's tile = acc (x alpha) (+ beta x bias), elementwise in fp32, in C's dtype."""
        if SCALED:
            acc = acc * alpha
        if HAS_BIAS:
            bias_ptrs = bias_ptr + rm[:, None].to(tl.int64) * stride_bias_m + rn[None, :] * stride_bias_n
            bias = tl.load(bias_ptrs, mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0).to(tl.float32)
            acc = acc + beta * bias
        c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _product_tile(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        """Rows rm (those < M) of A @ columns rn (< N) of B: K walked in BLOCK_K steps, in order, into fp32."""
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
        b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :].to(tl.int64) * stride_bn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = rk < K - k0
            a = tl.load(a_ptrs, mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & (rn[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        return acc

    @triton.jit
    def _invariant_matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                                 stride_cm, stride_cn, stride_bias_m, stride_bias_n, beta, alpha, stride_ab, stride_bb,
                                 stride_cb, stride_bias_b, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 GROUP_M: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        pdl.wait_and_release(PDL)
        batch = tl.program_id(1).to(tl.int64)  # a batched product's matrix (bmm: grid axis 1; one matrix: 0)
        a_ptr += batch * stride_ab
        b_ptr += batch * stride_bb
        c_ptr += batch * stride_cb
        bias_ptr += batch * stride_bias_b
        rm, rn = _tile_of_program(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _product_tile(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N,
                            BLOCK_K)  # fmt: skip
        _matmul_epilogue(acc, c_ptr, bias_ptr, rm, rn, M, N, stride_cm, stride_cn, stride_bias_m, stride_bias_n, beta,
                         alpha, HAS_BIAS, SCALED)  # fmt: skip

    @triton.jit
    def _tma_tile(a_desc, b_desc, c_ptr, bias_ptr, tile, M, N, K, stride_cm, stride_cn, stride_bias_m, stride_bias_n,
                  beta, alpha, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, B_NK: tl.constexpr):  # fmt: skip
        m0, n0 = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ks in range(tl.cdiv(K, BLOCK_K)):
            a = a_desc.load([m0, ks * BLOCK_K])
            if B_NK:
                b = b_desc.load([n0, ks * BLOCK_K]).T
            else:
                b = b_desc.load([ks * BLOCK_K, n0])
            acc = tl.dot(a, b, acc)
        _matmul_epilogue(acc, c_ptr, bias_ptr, m0 + tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N), M, N, stride_cm,
                         stride_cn, stride_bias_m, stride_bias_n, beta, alpha, HAS_BIAS, SCALED)  # fmt: skip

    @triton.jit
    def _invariant_matmul_tma_kernel(a_desc, b_desc, c_ptr, bias_ptr, M, N, K, stride_cm, stride_cn, stride_bias_m,
                                     stride_bias_n, beta, alpha, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr,
                                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                     GROUP_M: tl.constexpr, B_NK: tl.constexpr, PERSISTENT: tl.constexpr,
                                     NUM_SMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                                     PDL: tl.constexpr):  # fmt: skip
        """_invariant_matmul_kernel's tiles and K walk with A and B loaded by the TMA (zeros past their edges, as the
        masked loads give): one tile per program, or (PERSISTENT) at most NUM_SMS programs each taking every
        NUM_SMS-th tile, the next tile's loads under this one's epilogue. B is (K, N) in b_desc, or (N, K) where B_NK
        (a transposed weight: its K contiguous)."""
        pdl.wait_and_release(PDL)
        if PERSISTENT:
            num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
            for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=not WARP_SPECIALIZE,
                                 warp_specialize=WARP_SPECIALIZE):  # fmt: skip
                _tma_tile(a_desc, b_desc, c_ptr, bias_ptr, tile, M, N, K, stride_cm, stride_cn, stride_bias_m,
                          stride_bias_n, beta, alpha, HAS_BIAS, SCALED, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                          B_NK)  # fmt: skip
        else:
            _tma_tile(a_desc, b_desc, c_ptr, bias_ptr, tl.program_id(0), M, N, K, stride_cm, stride_cn, stride_bias_m,
                      stride_bias_n, beta, alpha, HAS_BIAS, SCALED, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                      B_NK)  # fmt: skip

    @triton.jit
    def _tree_product_tile(a_ptr, b_ptr, rm, rn, M, N, KC, stride_am, stride_ak, stride_bk, stride_bn,
                           CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):  # fmt: skip
        """Rows rm (< M) of A @ columns rn (< N) of B as the tree product (tree_matmul): each of CHUNKS chunks of KC
        walked in BLOCK_K steps into an fp32 tile of its own, the chunks' tiles summed pairwise, neighbours first."""
        # the sums of the last 1, 2 and 4 leaves not yet paired (collectives.tree_sum's tree, built left to right)
        s0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        s1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        s2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for c in tl.static_range(CHUNKS):
            k_first = (KC * c).to(tl.int64)  # the chunk's first K index (int64: a weight's offsets may pass 2**31)
            part = _product_tile(a_ptr + k_first * stride_ak, b_ptr + k_first * stride_bk, rm, rn, M, N, KC, stride_am,
                                 stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
            if c % 2 == 0:
                s0 = part
            else:
                part = s0 + part
                if c % 4 == 1:
                    s1 = part
                else:
                    part = s1 + part
                    if c % 8 == 3:
                        s2 = part
                    else:
                        part = s2 + part
        if CHUNKS == 1:
            part = s0
        elif CHUNKS == 2:
            part = s1
        elif CHUNKS == 4:
            part = s2
        return part

    @triton.jit
    def _tree_matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, KC, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                            stride_cn, CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        pdl.wait_and_release(PDL)
        rm, rn = _tile_of_program(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        part = _tree_product_tile(a_ptr, b_ptr, rm, rn, M, N, KC, stride_am, stride_ak, stride_bk, stride_bn, CHUNKS,
                                  BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
        tl.store(c_ptrs, part, mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _grouped_matmul_kernel(a_ptr, b_ptr, c_ptr, cu_ptr, num_groups, slots, N, K, stride_am, stride_ak, stride_bg,
                               stride_bk, stride_bn, stride_cm, stride_cn, CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                               SEQ_BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        """grouped_matmul: group g's rows cu[g]..cu[g+1]-1 of A @ B[g], in tiles of BLOCK_M rows from the group's first
        row. A program owns row tile `slot` of an upper bound of them and finds its group as attention finds a tile's
        sequence (_seq_of_tile); past the last tile it does nothing. CHUNKS 0: the plain K walk; else the tree's."""
        pdl.wait_and_release(PDL)
        m0, n0 = _grouped_tile(tl.program_id(0), slots * BLOCK_M, N, BLOCK_M, BLOCK_N, GROUP_M)
        slot = m0 // BLOCK_M
        g, first = _seq_of_tile(slot, cu_ptr, num_groups, BLOCK_M, SEQ_BLOCK)
        if g < num_groups:
            end = tl.load(cu_ptr + g + 1).to(tl.int32)
            rm = tl.load(cu_ptr + g).to(tl.int32) + (slot - first) * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = n0 + tl.arange(0, BLOCK_N)
            b_ptr += g.to(tl.int64) * stride_bg
            if CHUNKS == 0:
                acc = _product_tile(a_ptr, b_ptr, rm, rn, end, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                                    BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
            else:
                acc = _tree_product_tile(a_ptr, b_ptr, rm, rn, end, N, K // CHUNKS, stride_am, stride_ak, stride_bk,
                                         stride_bn, CHUNKS, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
            c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < end) & (rn[None, :] < N))

    @triton.jit
    def _seq_of_tile(tile, cu_ptr, num_seqs, TOKENS: tl.constexpr, SEQ_BLOCK: tl.constexpr):
        """(seq, first): the sequence whose new tokens tile `tile` holds and that sequence's first tile, sequence b's
        new tokens taking cdiv(q_len_b, TOKENS) tiles in order; past the last tile, seq >= num_seqs and first is the
        number of tiles."""
        seq = 0
        first = 0
        before = 0  # tiles of the sequences of earlier blocks
        for s0 in range(0, num_seqs, SEQ_BLOCK):
            b = s0 + tl.arange(0, SEQ_BLOCK)
            ok = b < num_seqs
            lo = tl.load(cu_ptr + b, mask=ok, other=0).to(tl.int32)
            hi = tl.load(cu_ptr + b + 1, mask=ok, other=0).to(tl.int32)
            tiles = (hi - lo + TOKENS - 1) // TOKENS
            ends = before + tl.cumsum(tiles, 0)
            done = ends <= tile  # sequences wholly before the tile (an empty one with them)
            seq += tl.sum(done.to(tl.int32), 0)
            first += tl.sum(tl.where(done, tiles, 0), 0)
            before += tl.sum(tiles, 0)
        return seq, first

    @triton.jit
    def _zero_rows_after(o_ptr, cu_ptr, num_seqs, num_tokens, kvh, stride_om, stride_oh, GROUP: tl.constexpr,
                         GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
        """Zeros in this kv head's q heads of the rows after the last sequence's new tokens (none, unless padded)."""
        r = tl.arange(0, TOKENS * GROUP_PAD)
        g = r % GROUP_PAD
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUP + g
        zeros = tl.zeros([TOKENS * GROUP_PAD, HEAD_DIM], o_ptr.dtype.element_ty)
        for t0 in range(tl.load(cu_ptr + num_seqs).to(tl.int32), num_tokens, TOKENS):
            tok = t0 + r // GROUP_PAD
            ok = (tok < num_tokens) & (g < GROUP)
            o_ptrs = o_ptr + tok[:, None].to(tl.int64) * stride_om + heads[:, None] * stride_oh + d[None, :]
            tl.store(o_ptrs, zeros, mask=ok[:, None])

    @triton.jit
    def _tile_span(tile, first, seq, cu_ptr, ctx_ptr, TOKENS: tl.constexpr, PAGED: tl.constexpr):
        """A tile of TOKENS tokens: (q_start, num_q, kv_len, t0, last): its sequence's first new token's row, new
        tokens and context length, the tile's first token among the new ones, and the keys its last row sees, + 1."""
        q_start = tl.load(cu_ptr + seq).to(tl.int32)
        num_q = tl.load(cu_ptr + seq + 1).to(tl.int32) - q_start
        if PAGED:
            kv_len = tl.load(ctx_ptr + seq).to(tl.int32)
        else:  # a packed batch: a sequence's context is its own new tokens, stored at its rows
            kv_len = num_q
        t0 = (tile - first) * TOKENS
        return q_start, num_q, kv_len, t0, tl.minimum(kv_len, kv_len - num_q + t0 + TOKENS)

    @triton.jit
    def _rows(q_start, num_q, kv_len, t0, kvh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr):
        """TOKENS tokens from new token t0, x GROUP_PAD q heads: (token rows, q heads, validity, query positions)."""
        r = tl.arange(0, TOKENS * GROUP_PAD)
        tok = t0 + r // GROUP_PAD
        g = r % GROUP_PAD
        return (q_start + tok).to(tl.int64), kvh * GROUP + g, (tok < num_q) & (g < GROUP), kv_len - num_q + tok

    @triton.jit
    def _chunk_rows(tables_ptr, seq, kvh, q_start, kv_len, c0, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb,
                    block_size, CHUNK: tl.constexpr, PAGED: tl.constexpr, OFF64: tl.constexpr):  # fmt: skip
        """Keys c0..c0+CHUNK-1 of a sequence: (their K rows' and V rows' offsets in the pool, their positions, which
        exist). The offsets are int32 unless the pool has 2**31 elements or more (OFF64): fewer registers (ptxas for
        sm_90a, 64 rows, 4 warps, launched with 16-byte aligned pointers and strides: 243 against 248, no spill)."""
        t = c0 + tl.arange(0, CHUNK)
        t_ok = t < kv_len
        if PAGED:
            block = tl.load(tables_ptr + seq * stride_tb + t // block_size, mask=t_ok, other=0)
            slot = block * block_size + t % block_size
        else:
            slot = q_start + t
        if OFF64:
            slot = slot.to(tl.int64)
        return slot * stride_ks + kvh * stride_kh, slot * stride_vs + kvh * stride_vh, t, t_ok

    @triton.jit
    def _load_rows(ptr, row, row_ok, HEAD_DIM: tl.constexpr):
        """(CHUNK, HEAD_DIM) of K or V at those rows' offsets, zeros where a key does not exist."""
        d = tl.arange(0, HEAD_DIM)
        return tl.load(ptr + row[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)

    @triton.jit
    def _chunk_scores(q, pos, k, t, t_ok, scale):
        """The rows' scores over one chunk's keys, as (max, exp(score - max)); a row that sees none of them gets
        (-inf, 0). The chunk's state is (max, sum of exp, exp @ V)."""
        s = tl.dot(q, tl.trans(k)) * scale
        # every chunk through the mask, those every row sees too: without the select between them, the compiler fuses
        # the scale's multiply and the max's subtraction into one FMA (fma.rn.f32 in the PTX for sm_90a), and a row's
        # bits would follow whether its tile saw the chunk whole (a walk without the mask over such chunks gave other
        # bits on one H100, and no speed: benchmarks/results/2026-12-06/probes/
        # invariant_attention_probe-llama3-8b-1xH100-4340690.json, plans "-masked" against the others)
        s = tl.where(t_ok[None, :] & (t[None, :] <= pos[:, None]), s, float("-inf"))
        m = tl.max(s, 1)
        return m, tl.exp(s - tl.where(m == float("-inf"), 0.0, m)[:, None])

    @triton.jit
    def _chunk_values(p, v, ones):
        """A chunk's (sum of exp, exp @ V) over its keys, exp rounded to V's dtype for both, both on the tensor cores:
        the sum as the product with `ones` (CHUNK, 16), a column of ones and zeros (a row's zeros add nothing in any
        order). tl.sum's order follows the layout, which follows the rows and warps (a row's 64 keys on one warp at 64
        rows on 4 warps, over four at 16 rows on 4), the tensor cores' follows neither: a row gets the same bits at
        16 rows (mma.sync) as at 64 (wgmma)."""
        w = p.to(v.dtype)
        return tl.sum(tl.dot(w, ones), 1), tl.dot(w, v)

    @triton.jit
    def _subtile_q(q_ptr, q_start, num_q, kv_len, t0, kvh, stride_qm, stride_qh, GROUP: tl.constexpr,
                   GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
        """A sub-tile's rows (_rows) and their q: (q, token rows, q heads, validity, query positions)."""
        q_rows, heads, row_ok, pos = _rows(q_start, num_q, kv_len, t0, kvh, GROUP, GROUP_PAD, TOKENS)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qm + heads[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None], other=0.0)  # fmt: skip
        return q, q_rows, heads, row_ok, pos

    @triton.jit
    def _store_rows(o_ptr, q_rows, heads, row_ok, l_i, acc, d, stride_om, stride_oh):
        """The rows' output at columns d (acc holds those columns)."""
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = o_ptr + q_rows[:, None] * stride_om + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _store(o_ptr, ws_ml_ptr, ws_acc_ptr, q_rows, heads, row_ok, m_i, l_i, acc, num_tokens, stride_om, stride_oh,
               GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
        """The rows' output (SPLIT_K False); or their state over this program's chunk (merged into the empty state,
        which changes no value it keeps) at (chunk, token row, q head): m and l in ws_ml (chunks, 2, M, H), acc in
        ws_acc (chunks, M, H, D)."""
        if SPLIT_K:
            d = tl.arange(0, HEAD_DIM)
            num_heads = tl.num_programs(1) * GROUP
            at = (tl.program_id(2) * 2 * num_tokens + q_rows) * num_heads + heads
            tl.store(ws_ml_ptr + at, m_i, mask=row_ok)
            tl.store(ws_ml_ptr + at + num_tokens * num_heads, l_i, mask=row_ok)
            at = (tl.program_id(2) * num_tokens + q_rows) * num_heads + heads
            tl.store(ws_acc_ptr + at[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
        else:
            _store_rows(o_ptr, q_rows, heads, row_ok, l_i, acc, tl.arange(0, HEAD_DIM), stride_om, stride_oh)

    @triton.jit
    def _merge_state(m_a, l_a, acc_a, m_b, l_b, acc_b):
        """Two softmax states of disjoint key chunks as one (b's keys after a's)."""
        m = tl.maximum(m_a, m_b)
        safe = tl.where(m == float("-inf"), 0.0, m)
        wa = tl.exp(m_a - safe)
        wb = tl.exp(m_b - safe)
        # the FMAs spelled out: a + b left to the compiler may contract either product into an FMA, and which one can
        # follow the code around the inlined call (the in-kernel merge against _merge_chunks_kernel's)
        return m, tl.fma(l_a, wa, l_b * wb), tl.fma(acc_a, wa[:, None], acc_b * wb[:, None])

    @triton.jit
    def _invariant_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, ws_ml_ptr, ws_acc_ptr, cu_ptr, ctx_ptr, tables_ptr,
                                    num_seqs, num_tokens, stride_qm, stride_qh, stride_ks, stride_kh, stride_vs,
                                    stride_vh, stride_om, stride_oh, stride_tb, block_size, scale,
                                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr,
                                    HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, PAGED: tl.constexpr,
                                    SPLIT_K: tl.constexpr, SEQ_BLOCK: tl.constexpr, PDL: tl.constexpr,
                                    SUB: tl.constexpr = 1, OFF64: tl.constexpr = True):  # fmt: skip
        """One program per (tile, kv head), merging the tile's key chunks' states in key order (SPLIT_K False); or one
        per (tile, kv head, chunk), writing the chunk's state to the workspace for _merge_chunks_kernel (SPLIT_K
        True). A tile is SUB sub-tiles of TOKENS tokens, each its own product over the chunk's K/V (loaded once)."""
        pdl.wait_and_release(PDL)  # the offsets, q and the new K/V may be the kernels' just before
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        seq, first = _seq_of_tile(tile, cu_ptr, num_seqs, SUB * TOKENS, SEQ_BLOCK)
        if seq >= num_seqs:
            if (tile == first) & (tl.program_id(2) == 0):  # the first program past the last tile
                _zero_rows_after(o_ptr, cu_ptr, num_seqs, num_tokens, kvh, stride_om, stride_oh, GROUP, GROUP_PAD,
                                 SUB * TOKENS, HEAD_DIM)  # fmt: skip
            return
        q_start, num_q, kv_len, t0, last = _tile_span(tile, first, seq, cu_ptr, ctx_ptr, SUB * TOKENS, PAGED)
        if SPLIT_K:
            if tl.program_id(2) * CHUNK >= last:
                return
        q0, rows0, heads0, ok0, pos0 = _subtile_q(q_ptr, q_start, num_q, kv_len, t0, kvh, stride_qm, stride_qh, GROUP,
                                                  GROUP_PAD, TOKENS, HEAD_DIM)  # fmt: skip
        if SUB >= 2:
            q1, rows1, heads1, ok1, pos1 = _subtile_q(q_ptr, q_start, num_q, kv_len, t0 + TOKENS, kvh, stride_qm,
                                                      stride_qh, GROUP, GROUP_PAD, TOKENS, HEAD_DIM)  # fmt: skip
        if SUB >= 4:
            q2, rows2, heads2, ok2, pos2 = _subtile_q(q_ptr, q_start, num_q, kv_len, t0 + 2 * TOKENS, kvh, stride_qm,
                                                      stride_qh, GROUP, GROUP_PAD, TOKENS, HEAD_DIM)  # fmt: skip
            q3, rows3, heads3, ok3, pos3 = _subtile_q(q_ptr, q_start, num_q, kv_len, t0 + 3 * TOKENS, kvh, stride_qm,
                                                      stride_qh, GROUP, GROUP_PAD, TOKENS, HEAD_DIM)  # fmt: skip
        if SPLIT_K:  # this program's chunk alone, its state to the workspace
            c_lo = tl.program_id(2) * CHUNK
            c_hi = c_lo + CHUNK
        else:
            c_lo = 0
            c_hi = last
        m0 = tl.full([TOKENS * GROUP_PAD], float("-inf"), tl.float32)
        l0 = tl.zeros([TOKENS * GROUP_PAD], tl.float32)
        a0 = tl.zeros([TOKENS * GROUP_PAD, HEAD_DIM], tl.float32)
        if SUB >= 2:
            m1, l1, a1 = m0, l0, a0
        if SUB >= 4:
            m2, l2, a2 = m0, l0, a0
            m3, l3, a3 = m0, l0, a0
        ones = ((tl.arange(0, CHUNK)[:, None] >= 0) & (tl.arange(0, 16)[None, :] == 0)).to(v_ptr.dtype.element_ty)
        for c0 in range(c_lo, c_hi, CHUNK):
            k_row, v_row, t, t_ok = _chunk_rows(tables_ptr, seq, kvh, q_start, kv_len, c0, stride_ks, stride_kh,
                                                stride_vs, stride_vh, stride_tb, block_size, CHUNK,
                                                PAGED, OFF64)  # fmt: skip
            # K, then V: never both in registers
            k = _load_rows(k_ptr, k_row, t_ok, HEAD_DIM)
            m_c0, p0 = _chunk_scores(q0, pos0, k, t, t_ok, scale)
            if SUB >= 2:
                m_c1, p1 = _chunk_scores(q1, pos1, k, t, t_ok, scale)
            if SUB >= 4:
                m_c2, p2 = _chunk_scores(q2, pos2, k, t, t_ok, scale)
                m_c3, p3 = _chunk_scores(q3, pos3, k, t, t_ok, scale)
            v = _load_rows(v_ptr, v_row, t_ok, HEAD_DIM)
            l_c0, a_c0 = _chunk_values(p0, v, ones)
            m0, l0, a0 = _merge_state(m0, l0, a0, m_c0, l_c0, a_c0)
            if SUB >= 2:
                l_c1, a_c1 = _chunk_values(p1, v, ones)
                m1, l1, a1 = _merge_state(m1, l1, a1, m_c1, l_c1, a_c1)
            if SUB >= 4:
                l_c2, a_c2 = _chunk_values(p2, v, ones)
                m2, l2, a2 = _merge_state(m2, l2, a2, m_c2, l_c2, a_c2)
                l_c3, a_c3 = _chunk_values(p3, v, ones)
                m3, l3, a3 = _merge_state(m3, l3, a3, m_c3, l_c3, a_c3)
        _store(o_ptr, ws_ml_ptr, ws_acc_ptr, rows0, heads0, ok0, m0, l0, a0, num_tokens, stride_om, stride_oh,
               GROUP, HEAD_DIM, SPLIT_K)  # fmt: skip
        if SUB >= 2:
            _store(o_ptr, ws_ml_ptr, ws_acc_ptr, rows1, heads1, ok1, m1, l1, a1, num_tokens, stride_om, stride_oh,
                   GROUP, HEAD_DIM, SPLIT_K)  # fmt: skip
        if SUB >= 4:
            _store(o_ptr, ws_ml_ptr, ws_acc_ptr, rows2, heads2, ok2, m2, l2, a2, num_tokens, stride_om, stride_oh,
                   GROUP, HEAD_DIM, SPLIT_K)  # fmt: skip
            _store(o_ptr, ws_ml_ptr, ws_acc_ptr, rows3, heads3, ok3, m3, l3, a3, num_tokens, stride_om, stride_oh,
                   GROUP, HEAD_DIM, SPLIT_K)  # fmt: skip

    @triton.jit
    def _chunk_state(ws_ml_ptr, ws_acc_ptr, c, n, q_rows, heads, row_ok, d, num_tokens, num_heads,
                     HEAD_DIM: tl.constexpr):  # fmt: skip
        """Chunk c's state (m, l, acc at columns d) from the workspace; from chunk n on, the empty state, whose merge
        changes nothing."""
        ok = row_ok & (c < n)
        at = (c * 2 * num_tokens + q_rows) * num_heads + heads
        m = tl.load(ws_ml_ptr + at, mask=ok, other=float("-inf"))
        l = tl.load(ws_ml_ptr + at + num_tokens * num_heads, mask=ok, other=0.0)
        at = (c * num_tokens + q_rows) * num_heads + heads
        acc = tl.load(ws_acc_ptr + at[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
        return m, l, acc

    @triton.jit
    def _four_states(ws_ml_ptr, ws_acc_ptr, c, n, q_rows, heads, row_ok, d, num_tokens, num_heads,
                     HEAD_DIM: tl.constexpr):  # fmt: skip
        """Chunks c to c + 3's states, their loads issued together."""
        s0 = _chunk_state(ws_ml_ptr, ws_acc_ptr, c, n, q_rows, heads, row_ok, d, num_tokens, num_heads, HEAD_DIM)
        s1 = _chunk_state(ws_ml_ptr, ws_acc_ptr, c + 1, n, q_rows, heads, row_ok, d, num_tokens, num_heads, HEAD_DIM)
        s2 = _chunk_state(ws_ml_ptr, ws_acc_ptr, c + 2, n, q_rows, heads, row_ok, d, num_tokens, num_heads, HEAD_DIM)
        s3 = _chunk_state(ws_ml_ptr, ws_acc_ptr, c + 3, n, q_rows, heads, row_ok, d, num_tokens, num_heads, HEAD_DIM)
        return s0, s1, s2, s3

    @triton.jit
    def _merge_four(m_i, l_i, acc, states):
        """The state merged with four chunks' states (_four_states), in their order."""
        for i in tl.static_range(4):
            m_c, l_c, a_c = states[i]
            m_i, l_i, acc = _merge_state(m_i, l_i, acc, m_c, l_c, a_c)
        return m_i, l_i, acc

    @triton.jit
    def _merge_chunks_kernel(o_ptr, ws_ml_ptr, ws_acc_ptr, cu_ptr, ctx_ptr, num_seqs, num_tokens, stride_om,
                            stride_oh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr,
                            HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, PAGED: tl.constexpr,
                            SEQ_BLOCK: tl.constexpr, PDL: tl.constexpr, SUB: tl.constexpr = 1,
                            D_BLOCK: tl.constexpr = MERGE_COLUMNS, GROUP_LOADS: tl.constexpr = 4):  # fmt: skip
        """The chunks' states merged in key order, as _invariant_attention_kernel merges them in one program (the
        tile's SUB x TOKENS tokens at once: no product here), D_BLOCK columns a program (a column's merge is its own:
        m and l are each row's, recomputed alike in every program). GROUP_LOADS (4 or 16) chunks' loads are issued
        before their merges, in order: a decode's few programs wait on one memory latency per group, not per chunk."""
        pdl.wait_and_release(PDL)  # the workspace is the kernel's just before
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        seq, first = _seq_of_tile(tile, cu_ptr, num_seqs, SUB * TOKENS, SEQ_BLOCK)
        if seq >= num_seqs:
            return
        q_start, num_q, kv_len, t0, last = _tile_span(tile, first, seq, cu_ptr, ctx_ptr, SUB * TOKENS, PAGED)
        q_rows, heads, row_ok, _ = _rows(q_start, num_q, kv_len, t0, kvh, GROUP, GROUP_PAD, SUB * TOKENS)
        d = tl.program_id(2) * D_BLOCK + tl.arange(0, D_BLOCK)
        num_heads = tl.num_programs(1) * GROUP
        m_i = tl.full([SUB * TOKENS * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([SUB * TOKENS * GROUP_PAD], tl.float32)
        acc = tl.zeros([SUB * TOKENS * GROUP_PAD, D_BLOCK], tl.float32)
        n = tl.cdiv(last, CHUNK)
        tl.static_assert((GROUP_LOADS == 4) | (GROUP_LOADS == 16))
        for c in range(0, n, GROUP_LOADS):
            s0 = _four_states(ws_ml_ptr, ws_acc_ptr, c, n, q_rows, heads, row_ok, d, num_tokens, num_heads, HEAD_DIM)
            if GROUP_LOADS == 16:
                s1 = _four_states(ws_ml_ptr, ws_acc_ptr, c + 4, n, q_rows, heads, row_ok, d, num_tokens, num_heads,
                                  HEAD_DIM)  # fmt: skip
                s2 = _four_states(ws_ml_ptr, ws_acc_ptr, c + 8, n, q_rows, heads, row_ok, d, num_tokens, num_heads,
                                  HEAD_DIM)  # fmt: skip
                s3 = _four_states(ws_ml_ptr, ws_acc_ptr, c + 12, n, q_rows, heads, row_ok, d, num_tokens, num_heads,
                                  HEAD_DIM)  # fmt: skip
            m_i, l_i, acc = _merge_four(m_i, l_i, acc, s0)
            if GROUP_LOADS == 16:
                m_i, l_i, acc = _merge_four(m_i, l_i, acc, s1)
                m_i, l_i, acc = _merge_four(m_i, l_i, acc, s2)
                m_i, l_i, acc = _merge_four(m_i, l_i, acc, s3)
        _store_rows(o_ptr, q_rows, heads, row_ok, l_i, acc, d, stride_om, stride_oh)


def matmul(a: Tensor, b: Tensor, bias: Tensor | None = None, beta: float = 1.0, alpha: float = 1.0, *,
           tiling: MatmulTiling | None = None) -> Tensor:  # fmt: skip
    """a (M, K) @ b (K, N) (any strides), or alpha * (a @ b) + beta * bias (broadcast to (M, N)), in a's dtype
    (module doc: the product's reduction order; the epilogue is elementwise, in fp32). `tiling` overrides the launch
    shape (probes, tests): it changes no bit of the result."""
    m, k = a.shape
    n = b.shape[1]
    out = a.new_empty(m, n)
    if m == 0 or n == 0:
        return out
    if bias is not None:
        bias = torch.broadcast_to(bias, (m, n))
    t = tiling or tiling_for(m, n, k)
    tiles = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    on = pdl.enabled(a.device)
    if t.tma and _tma_describes(a, b):
        b_nk = b.stride(0) == 1  # a transposed weight: described as the (N, K) tensor it views
        a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [t.block_m, t.block_k])
        if b_nk:
            b_desc = TensorDescriptor(b, [n, k], [b.stride(1), 1], [t.block_n, t.block_k])
        else:
            b_desc = TensorDescriptor(b, [k, n], [b.stride(0), 1], [t.block_k, t.block_n])
        sms = num_sms(a.device) if t.persistent else 0
        _invariant_matmul_tma_kernel[(min(tiles, sms) if t.persistent else tiles,)](
            a_desc, b_desc, out, bias if bias is not None else out, m, n, k, out.stride(0), out.stride(1),
            *(bias.stride() if bias is not None else (0, 0)), float(beta), float(alpha), HAS_BIAS=bias is not None,
            SCALED=alpha != 1.0, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
            B_NK=b_nk, PERSISTENT=t.persistent, NUM_SMS=sms, WARP_SPECIALIZE=t.warp_specialize, PDL=on,
            num_warps=t.num_warps, num_stages=t.num_stages, launch_pdl=on,
        )  # fmt: skip
        return out
    _invariant_matmul_kernel[(tiles, 1)](
        a, b, out, bias if bias is not None else out, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), *(bias.stride() if bias is not None else (0, 0)), float(beta), float(alpha),
        0, 0, 0, 0, HAS_BIAS=bias is not None, SCALED=alpha != 1.0, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, GROUP_M=t.group_m, PDL=on, num_warps=t.num_warps, num_stages=t.num_stages, launch_pdl=on,
    )  # fmt: skip
    return out


def bmm_tiling_for(m: int) -> MatmulTiling:
    """The batched product's launch shape (the pointer kernel; any gives the same bits): 16-row tiles to 16 rows,
    64 to 64, then 128 x 128."""
    if m <= 16:
        return TINY_M_TILING
    return SMALL_M_TILING if m <= 64 else LARGE_M_TILING


def bmm(a: Tensor, b: Tensor, bias: Tensor | None = None, beta: float = 1.0, alpha: float = 1.0, *,
        tiling: MatmulTiling | None = None) -> Tensor:  # fmt: skip
    """a (B, M, K) @ b (B, K, N) (any strides), or alpha * (a @ b) + beta * bias (broadcast to (B, M, N)), in a's
    dtype, in one launch: each matrix's tiles and K walk are `matmul`'s, so matrix i's result is matmul(a[i], b[i])'s
    bits under the pointer kernel (any tiling)."""
    nb, m, k = a.shape
    n = b.shape[2]
    out = a.new_empty(nb, m, n)
    if nb == 0 or m == 0 or n == 0:
        return out
    if bias is not None:
        bias = torch.broadcast_to(bias, (nb, m, n))
    t = tiling or bmm_tiling_for(m)
    if t.tma:
        raise ValueError(f"bmm: {t} is a TMA launch shape; the batched product runs the pointer kernel")
    tiles = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    on = pdl.enabled(a.device)
    bias_strides = bias.stride() if bias is not None else (0, 0, 0)
    _invariant_matmul_kernel[(tiles, nb)](
        a, b, out, bias if bias is not None else out, m, n, k, a.stride(1), a.stride(2), b.stride(1), b.stride(2),
        out.stride(1), out.stride(2), *bias_strides[1:], float(beta), float(alpha), a.stride(0), b.stride(0),
        out.stride(0), bias_strides[0], HAS_BIAS=bias is not None, SCALED=alpha != 1.0, BLOCK_M=t.block_m,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m, PDL=on, num_warps=t.num_warps,
        num_stages=t.num_stages, launch_pdl=on,
    )  # fmt: skip
    return out


def grouped_matmul(a: Tensor, b: Tensor, offs: Tensor, *, chunks: int = 0,
                   tiling: MatmulTiling | None = None) -> Tensor:  # fmt: skip
    """A grouped product (a mixture of experts' experts) in one launch, no host sync: a (S, K) with its rows sorted by
    group, b (G, K, N) (any strides), offs (G,) each group's end row; group g's rows @ b[g] in a's dtype, rows past
    the last group zero. chunks 0: each row the bits of `matmul`'s product of its group's rows alone (any tiling);
    1, 2, 4 or 8: of `tree_matmul`'s over that many chunks, rounded to a's dtype."""
    s, k = a.shape
    groups, _, n = b.shape
    out = a.new_zeros(s, n)
    if s == 0 or n == 0 or groups == 0:
        return out
    if chunks and (chunks not in TREE_CHUNKS or k % chunks):
        raise ValueError(f"grouped tree matmul: K = {k} in {chunks} chunks (1, 2, 4 or 8, dividing K)")
    t = TREE_TILING if chunks else tiling or bmm_tiling_for(triton.cdiv(s, groups))
    if t.tma:
        raise ValueError(f"grouped_matmul: {t} is a TMA launch shape; the grouped product runs the pointer kernel")
    # a group of r rows takes cdiv(r, BLOCK_M) row tiles: at most cdiv(S, BLOCK_M) + G of them, and at most S
    slots = min(triton.cdiv(s, t.block_m) + groups, s)
    cu = torch.nn.functional.pad(offs, (1, 0))  # (G + 1,): group g's rows cu[g]..cu[g + 1] - 1
    on = pdl.enabled(a.device)
    _grouped_matmul_kernel[(slots * triton.cdiv(n, t.block_n),)](
        a, b, out, cu, groups, slots, n, k, a.stride(0), a.stride(1), *b.stride(), out.stride(0), out.stride(1),
        CHUNKS=chunks, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        SEQ_BLOCK=SEQ_BLOCK, PDL=on, num_warps=t.num_warps, num_stages=t.num_stages, launch_pdl=on,
    )  # fmt: skip
    return out


def _tma_describes(a: Tensor, b: Tensor) -> bool:
    """Whether the TMA can load a (M, K) and b (K, N) as they are: 16-byte aligned bases and row strides, a's K and one
    of b's dims contiguous."""
    if TensorDescriptor is None:
        return False
    size = a.element_size()

    def aligned(t: Tensor, row_stride: int) -> bool:  # a broadcast (stride 0) row is no tensor map's
        return t.data_ptr() % 16 == 0 and row_stride > 0 and (row_stride * size) % 16 == 0

    b_ok = (b.stride(0) == 1 and aligned(b, b.stride(1))) or (b.stride(1) == 1 and aligned(b, b.stride(0)))
    return a.stride(1) == 1 and aligned(a, a.stride(0)) and b_ok


def tree_matmul(a: Tensor, b: Tensor, chunks: int) -> Tensor:
    """a (M, K) @ b (K, N) in fp32 as the "tp" level's tree product (ops/invariant.py, K_CHUNKS): K in `chunks` equal
    chunks (1, 2, 4 or 8), each chunk's product walked in BLOCK_K steps in order into an fp32 tile of its own, the
    chunks summed pairwise, neighbours first (collectives.tree_sum). One launch shape at every M, N and K, so an
    element's product is the same whatever the other rows and columns; a rank's product over its 8 / W chunks of a
    row-parallel K is the subtree the whole product has over those chunks."""
    m, k = a.shape
    n = b.shape[1]
    if chunks not in TREE_CHUNKS or k % chunks:
        raise ValueError(f"tree matmul: K = {k} in {chunks} chunks (1, 2, 4 or 8, dividing K)")
    out = torch.empty(m, n, dtype=torch.float32, device=a.device)
    if m == 0 or n == 0:
        return out
    t = TREE_TILING
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    on = pdl.enabled(a.device)
    _tree_matmul_kernel[grid](
        a, b, out, m, n, k // chunks, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        CHUNKS=chunks, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m, PDL=on,
        num_warps=t.num_warps, num_stages=t.num_stages, launch_pdl=on,
    )  # fmt: skip
    return out


def _group_pad(group: int) -> int:
    return max(1, 1 << (group - 1).bit_length())


def attention(
    q_MHD: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    *,
    context_lens: Tensor | None = None,
    block_tables: Tensor | None = None,
    block_size: int = 1,
    scale: float,
    split: bool | None = None,
    launch: AttentionLaunch | None = None,
) -> Tensor:
    """Causal attention of each sequence's new tokens (module doc). Paged (context_lens and block_tables given): k / v
    (slots, K, D) the page pool, the new tokens' K/V already in it. Packed: k / v (M, K, D) the new tokens' own.
    `split` (one program per key chunk or not) and `launch` override the launch plan (probes, tests); neither changes
    a bit of the result."""
    q_MHD, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_MHD, k, v))
    num_tokens, num_heads, head_dim = q_MHD.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    group_pad = _group_pad(group)
    num_seqs = cu_seqlens_q.shape[0] - 1
    lp = launch or launch_for(num_tokens, num_seqs, group_pad, head_dim)
    if lp.subtiles not in (1, 2, 4):
        raise ValueError(f"invariant attention: {lp.subtiles} sub-tiles per program (1, 2 or 4)")
    tokens = max(1, lp.rows // group_pad)  # per sub-tile; a tile holds lp.subtiles x tokens
    tile_tokens = lp.subtiles * tokens
    if num_tokens == 0 or num_seqs == 0:
        return q_MHD.new_zeros(q_MHD.shape)
    out = q_MHD.new_empty(q_MHD.shape)  # every row written: a tile's, or zeros after the last sequence's
    cu = cu_seqlens_q  # int32 or int64, read as it is (a cast would be a launch)
    # at most cdiv(q_len_b, tile_tokens) <= (q_len_b - 1) // tile_tokens + 1 tiles per sequence: at least one program
    # is past the last tile, which zeroes the padding rows
    grid_tiles = triton.cdiv(num_tokens, tile_tokens) + num_seqs
    paged = block_tables is not None
    if paged:
        ctx, tables = context_lens, block_tables
        stride_tb = tables.stride(0)
        max_keys = tables.shape[1] * block_size
    else:
        ctx, tables, stride_tb = cu, cu, 0
        max_keys = num_tokens
    if split is None:
        split = grid_tiles * num_kv < SPLIT_BELOW_PROGRAMS
    chunks = triton.cdiv(max_keys, KV_CHUNK) if split else 1
    if chunks > 1:
        ws_ml = torch.empty(chunks, 2, num_tokens, num_heads, dtype=torch.float32, device=q_MHD.device)
        ws_acc = torch.empty(chunks, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q_MHD.device)
    else:
        ws_ml = ws_acc = out
    on = pdl.enabled(q_MHD.device)
    meta = dict(GROUP=group, GROUP_PAD=group_pad, TOKENS=tokens, HEAD_DIM=head_dim, CHUNK=KV_CHUNK, PAGED=paged,
                SEQ_BLOCK=SEQ_BLOCK, PDL=on, SUB=lp.subtiles)  # fmt: skip
    off64 = max(k.numel(), v.numel()) >= 2**31 or max(k.stride(0), v.stride(0)) * k.shape[0] >= 2**31
    _invariant_attention_kernel[(grid_tiles, num_kv, chunks)](
        q_MHD, k, v, out, ws_ml, ws_acc, cu, ctx, tables, num_seqs, num_tokens, q_MHD.stride(0), q_MHD.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), stride_tb, block_size,
        float(scale), **meta, SPLIT_K=chunks > 1, OFF64=off64, num_warps=lp.num_warps, num_stages=lp.num_stages,
        maxnreg=lp.max_registers, launch_pdl=on,
    )  # fmt: skip
    if chunks > 1:
        d_block = min(head_dim, MERGE_COLUMNS)
        few_rows = lp.subtiles * tokens * group_pad <= DECODE_ROWS
        _merge_chunks_kernel[(grid_tiles, num_kv, head_dim // d_block)](
            out, ws_ml, ws_acc, cu, ctx, num_seqs, num_tokens, out.stride(0), out.stride(1), **meta, D_BLOCK=d_block,
            GROUP_LOADS=MERGE_GROUP_FEW_ROWS if few_rows else 4, num_warps=4, launch_pdl=on,
        )  # fmt: skip
    return out
