"""Decode-size linear layers: y (M, N) = x (M, K) @ W (N, K)^T for a few rows M, as one Triton kernel that
streams W once, with no split-K (cuBLAS splits K for o_proj / down_proj shapes at M = 1 and adds a reduction
kernel per GEMM: 64 of a llama3-8b decode step's kernels).

A program owns BLOCK_N output columns (rows of W) and walks the whole K: at M = 1 it accumulates
W * x elementwise in fp32 and reduces once at the end; above, it pads M to a power of 2 >= 16 for tl.dot.
At M = 1 the first tile of W is loaded before the PDL wait (ops/pdl.py): on one H200 that took a llama3-8b decode
step at batch 1 from 4.26 to 4.20 ms, with the decode kernel's K/V tile before the wait too to 4.16 ms, and a second
tile lost (benchmarks/results/2026-12-02/probes/prefetch-probe-1xH200.json).
With `silu_mul`, x is (M, 2K) = [gate | up] and the input is silu(gate) * up (rounded to x's dtype once, as
Inductor's fused kernel does); at M = 1 the GEMV reads it so, and the MLP's activation kernel goes too.

`tpweave::rms_norm_linear` takes a residual add + RMSNorm in front of the linear layer: at M = 1 the GEMV adds the
residual, sums h^2 as it walks K and scales by 1 / rms at the end (`norm_gemv`); the pass uses it with the
`norm_gemv` compile option only (on one H200 it lost to the norm kernel + GEMV: docs/architecture.md).

`tpweave::linear` is the op the graph pass (compiler/decode_gemv.py) puts in place of a linear layer's matmul:
the kernel at M <= MAX_ROWS (more for a long K) on CUDA, torch's matmul otherwise (a graph serves every M; the
choice is made per call, once per CUDA-graph capture).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tpweave.ops import pdl, rms_norm

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_ROWS = 16  # the op takes the GEMV up to this many rows, cuBLAS beyond
# ... and up to this many for a long K (>= LONG_K), where cuBLAS splits K up to 64 rows (llama3-8b's down_proj at
# M = 64: 32.9 vs 34.9 us; benchmarks/results/2026-12-02/probes/gemv-probe-m32-64-1xH200.json)
MAX_ROWS_LONG_K, LONG_K = 64, 8192
KERNEL_MAX_ROWS = 128  # what the kernel itself takes (rows padded to a power of 2 >= 16 for tl.dot)


@dataclass(frozen=True)
class GemvTuning:
    """Launch parameters of one call: block_n columns per program, block_k of K per iteration; prefetch: the first
    tile of W is loaded before the PDL wait (ops/pdl.py; one row only)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    prefetch: bool = False


def tuning_for(m: int, n: int, k: int, *, silu_mul: bool = False) -> GemvTuning:
    """Launch parameters for these sizes: the best settings of benchmarks/probes/gemv_probe.py on one H200
    (llama3-8b shapes, benchmarks/results/2026-12-02/probes/gemv-probe-1xH200.json) as a rule of N and K."""
    if m == 1:  # one tile of W before the PDL wait (benchmarks/probes/prefetch_probe.py)
        if k >= 8192:
            return GemvTuning(block_n=8 if silu_mul else 16, block_k=1024, num_warps=4, num_stages=3, prefetch=True)
        if n <= 8192:
            return GemvTuning(block_n=8, block_k=512, num_warps=4, num_stages=3, prefetch=True)
        return GemvTuning(block_n=16, block_k=256, num_warps=4, num_stages=2, prefetch=True)
    # above one row, no prefetch: a tile held across the wait costs the shared memory of a pipeline stage
    if m > 16:
        return GemvTuning(block_n=32, block_k=256, num_warps=4, num_stages=4)
    if n >= 16384:
        return GemvTuning(block_n=64, block_k=128, num_warps=4, num_stages=3)
    if k >= 8192 or n <= 4096:
        return GemvTuning(block_n=32, block_k=512, num_warps=4, num_stages=4)
    return GemvTuning(block_n=64, block_k=256, num_warps=4, num_stages=4)


def supported(x_MK: Tensor, w_NK: Tensor, *, max_rows: int | None = None) -> bool:
    """Whether the kernel takes these inputs: CUDA fp16/bf16, same dtypes, W's rows contiguous, M <= max_rows
    (None: MAX_ROWS, or MAX_ROWS_LONG_K for a K >= LONG_K)."""
    if max_rows is None:
        max_rows = MAX_ROWS_LONG_K if w_NK.shape[-1] >= LONG_K else MAX_ROWS
    return (
        triton is not None
        and x_MK.is_cuda
        and x_MK.dim() == 2
        and w_NK.dim() == 2
        and x_MK.dtype in (torch.float16, torch.bfloat16)
        and w_NK.dtype == x_MK.dtype
        and w_NK.stride(1) == 1
        and x_MK.stride(-1) == 1
        and 0 < x_MK.shape[0] <= min(max_rows, KERNEL_MAX_ROWS)
    )


def block_m(m: int) -> int:
    """The kernel's row block for m rows: 1 (the elementwise path), else a power of 2 >= 16 (tl.dot)."""
    return 1 if m == 1 else max(16, triton.next_power_of_2(m))


def silu_and_mul(x_M2K: Tensor) -> Tensor:
    """silu(gate) * up of x = [gate | up] (M, 2K), computed in fp32 and rounded once to x's dtype (as Inductor's
    fused kernel does): one Triton kernel on CUDA, the torch form elsewhere."""
    m, k = x_M2K.shape[0], x_M2K.shape[1] // 2
    if triton is None or not x_M2K.is_cuda or x_M2K.stride(-1) != 1:
        gate, up = x_M2K.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(x_M2K.dtype)
    out = torch.empty(m, k, dtype=x_M2K.dtype, device=x_M2K.device)
    if m:
        on = pdl.enabled(x_M2K.device)
        _silu_mul_kernel[(m, triton.cdiv(k, 1024))](
            x_M2K, out, k, x_M2K.stride(0), BLOCK=1024, PDL=on, num_warps=4, launch_pdl=on
        )
    return out


if triton is not None:

    @triton.jit
    def _activation(x_ptrs, mask, k, SILU_MUL: tl.constexpr):
        """x's tile at x_ptrs, or silu(gate) * up of the [gate | up] row (up k columns on), in x's dtype."""
        if SILU_MUL:
            gate = tl.load(x_ptrs, mask=mask, other=0.0)
            up = tl.load(x_ptrs + k, mask=mask, other=0.0).to(tl.float32)
            g = gate.to(tl.float32)
            return (g * tl.sigmoid(g) * up).to(gate.dtype)
        return tl.load(x_ptrs, mask=mask, other=0.0)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, K, stride_xm, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl.wait_and_release(PDL)
        m = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        x = _activation(x_ptr + m * stride_xm + cols, cols < K, K, True)
        tl.store(out_ptr + m * K + cols, x, mask=cols < K)

    @triton.jit
    def _row_tile(acc, sq, w, x_ptr, r_ptr, g_ptr, h_ptr, kk, K, SILU_MUL: tl.constexpr, NORM: tl.constexpr):
        """M = 1: acc (BLOCK_N, BLOCK_K) += W's tile w * the input at columns kk; with NORM, sq += h^2."""
        k_ok = kk < K
        if NORM:
            # h = x + residual in x's dtype; the norm's 1 / rms scales the sum at the end (norm_gemv)
            x = tl.load(x_ptr + kk, mask=k_ok, other=0.0)
            h = (x.to(tl.float32) + tl.load(r_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)).to(x.dtype)
            if tl.program_id(0) == 0:
                tl.store(h_ptr + kk, h, mask=k_ok)
            h32 = h.to(tl.float32)
            sq += h32 * h32
            xs = h32 * tl.load(g_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        else:
            xs = _activation(x_ptr + kk, k_ok, K, SILU_MUL).to(tl.float32)
        return acc + w.to(tl.float32) * xs[None, :], sq

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, r_ptr, g_ptr, h_ptr, eps,
        SILU_MUL: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        # With PREFETCH (one row only), the first tile of W (no kernel writes W) is loaded before the PDL wait, so
        # that it streams in while the kernel before this one finishes; the input x is read after it.
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
        kk = tl.arange(0, BLOCK_K)
        if PREFETCH:
            w0 = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & (kk < K)[None, :], other=0.0)
        pdl.wait_and_release(PDL)
        if BLOCK_M == 1:
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            sq = tl.zeros([BLOCK_K], tl.float32)
            if PREFETCH:
                acc, sq = _row_tile(acc, sq, w0, x_ptr, r_ptr, g_ptr, h_ptr, kk, K, SILU_MUL, NORM)
            for k0 in range(BLOCK_K if PREFETCH else 0, K, BLOCK_K):
                w = tl.load(w_rows + k0 + kk[None, :], mask=col_ok[:, None] & (k0 + kk < K)[None, :], other=0.0)
                acc, sq = _row_tile(acc, sq, w, x_ptr, r_ptr, g_ptr, h_ptr, k0 + kk, K, SILU_MUL, NORM)
            y = tl.sum(acc, axis=1)
            if NORM:
                y = y * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
            tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)
        else:
            rows = tl.arange(0, BLOCK_M)
            row_ok = rows < M
            x_rows = x_ptr + rows[:, None] * stride_xm
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = k0 + kk < K
                w = tl.load(w_rows + k0 + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_rows + k0 + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                acc = tl.dot(x, tl.trans(w), acc)
            y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def gemv(x_MK: Tensor, w_NK: Tensor, *, silu_mul: bool = False, tuning: GemvTuning | None = None) -> Tensor:
    """x @ W^T (silu(gate) * up @ W^T with silu_mul, x = [gate | up]) in x's dtype, by the Triton kernel; the
    inputs must be `supported`. The activation is read inside the GEMV at M = 1, by its own kernel above."""
    assert supported(x_MK, w_NK, max_rows=KERNEL_MAX_ROWS), "gemv: unsupported inputs (check supported() first)"
    if silu_mul and x_MK.shape[0] > 1:  # tl.dot of a computed operand measured slower than a separate kernel
        x_MK, silu_mul = silu_and_mul(x_MK), False
    m, n = x_MK.shape[0], w_NK.shape[0]
    k = x_MK.shape[1] // 2 if silu_mul else x_MK.shape[1]
    if w_NK.shape[1] != k:
        raise ValueError(f"gemv: x has {x_MK.shape[1]} columns, W has {w_NK.shape[1]} (silu_mul={silu_mul})")
    t = tuning or tuning_for(m, n, k, silu_mul=silu_mul)
    assert m == 1 or not t.prefetch, "gemv: prefetch is for one row"
    y = torch.empty(m, n, dtype=x_MK.dtype, device=x_MK.device)
    on = pdl.enabled(x_MK.device)
    _gemv_kernel[(triton.cdiv(n, t.block_n),)](
        x_MK, w_NK, y, m, n, k, x_MK.stride(0), w_NK.stride(0), y.stride(0), x_MK, x_MK, x_MK, 0.0,
        SILU_MUL=silu_mul, NORM=False, BLOCK_M=block_m(m), BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        PREFETCH=t.prefetch, PDL=on, num_warps=t.num_warps, num_stages=t.num_stages, launch_pdl=on,
    )  # fmt: skip
    return y


@torch.library.custom_op("tpweave::linear", mutates_args=())
def linear(x_MK: Tensor, w_NK: Tensor, silu_mul: bool = False) -> Tensor:
    """x @ W^T for a linear layer's weight W (N, K) (compiler/decode_gemv.py puts it in place of the graph's
    matmuls); with silu_mul, x (M, 2K) = [gate | up] and the input is silu(gate) * up. At most MAX_ROWS rows on
    CUDA (MAX_ROWS_LONG_K for a long K): the GEMV kernel; otherwise torch's matmul (cuBLAS), after silu_and_mul's
    kernel with silu_mul."""
    return _linear(x_MK, w_NK, silu_mul)


def _linear(x_MK: Tensor, w_NK: Tensor, silu_mul: bool) -> Tensor:
    """The op's body, for callers already inside an op (no second dispatch)."""
    if supported(x_MK, w_NK):
        return gemv(x_MK, w_NK, silu_mul=silu_mul)
    if silu_mul:
        x_MK = silu_and_mul(x_MK)
    return x_MK @ w_NK.t()


@linear.register_fake
def _(x_MK, w_NK, silu_mul=False):
    return x_MK.new_empty(x_MK.shape[0], w_NK.shape[0])


def norm_gemv(
    s_K: Tensor, residual_K: Tensor, norm_weight: Tensor, w_NK: Tensor, *, eps: float, tuning: GemvTuning | None = None
) -> tuple[Tensor, Tensor]:
    """One row: (rms_norm(h) @ W^T, h) for h = s + residual, in one GEMV kernel (s, residual: (1, K)). Each program
    sums h^2 over the K it walks anyway and scales its dot products by 1 / rms at the end: the normalized row is
    never rounded to the model dtype (the unfused norm rounds it once; the difference is within that rounding)."""
    assert supported(s_K, w_NK) and s_K.shape[0] == 1, "norm_gemv: one row the GEMV takes (check supported())"
    n, k = w_NK.shape
    t = tuning or tuning_for(1, n, k)
    y = torch.empty(1, n, dtype=s_K.dtype, device=s_K.device)
    h = torch.empty_like(s_K)
    on = pdl.enabled(s_K.device)
    _gemv_kernel[(triton.cdiv(n, t.block_n),)](
        s_K, w_NK, y, 1, n, k, s_K.stride(0), w_NK.stride(0), y.stride(0), residual_K, norm_weight, h, eps,
        SILU_MUL=False, NORM=True, BLOCK_M=1, BLOCK_N=t.block_n, BLOCK_K=t.block_k, PREFETCH=t.prefetch, PDL=on,
        num_warps=t.num_warps, num_stages=t.num_stages, launch_pdl=on,
    )  # fmt: skip
    return y, h


@torch.library.custom_op("tpweave::rms_norm_linear", mutates_args=())
def rms_norm_linear(
    s_MK: Tensor, residual_MK: Tensor, norm_weight: Tensor, w_NK: Tensor, eps: float, weight_in_fp32: bool
) -> tuple[Tensor, Tensor]:
    """(rms_norm(h) @ W^T, h) for the residual stream h = s + residual (compiler/decode_gemv.py puts it in place of
    a residual add + RMSNorm read by one linear layer alone; ops/rms_norm.py: the norm's two weight orders). One
    GEMV kernel at one row on CUDA (`norm_gemv`); otherwise the add + norm kernel, then `linear`."""
    if (
        s_MK.shape[0] == 1
        and supported(s_MK, w_NK)
        and residual_MK.dtype == s_MK.dtype
        and residual_MK.stride(-1) == 1
        and norm_weight.dim() == 1
        and norm_weight.stride(0) == 1
    ):
        return norm_gemv(s_MK, residual_MK, norm_weight, w_NK, eps=eps)
    y, h = rms_norm.add_rms_norm(s_MK, residual_MK, norm_weight, eps=eps, weight_in_fp32=weight_in_fp32)
    return _linear(y.to(w_NK.dtype), w_NK, False), h


@rms_norm_linear.register_fake
def _(s_MK, residual_MK, norm_weight, w_NK, eps, weight_in_fp32):
    return s_MK.new_empty(s_MK.shape[0], w_NK.shape[0]), s_MK.new_empty(s_MK.shape)
