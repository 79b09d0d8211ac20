"""tpweave's Triton kernels compiled for the GPU box (sm_90a) on a machine without a GPU: Triton's
front end and ptxas check every kernel, its inline PTX included (a wrong register name or operand
constraint otherwise shows only on the device). Skipped without triton; CI runs it with the box's
Triton (.ci/run). What it cannot check: anything at run time (results, races, speed)."""

import collections
import itertools
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tpweave.ops import paged_decode, rms_norm  # noqa: E402
from tpweave.ops.strategies import triton_ar_norm  # noqa: E402

H100_H200 = GPUTarget("cuda", 90, 32)
PTR = {"bfloat16": "*bf16", "float32": "*fp32"}


def compile_kernel(fn, arg_types: dict[str, str], constexprs: dict, *, num_warps: int, num_stages: int = 3,
                   aligned: tuple[str, ...] = (), maxnreg: int | None = None):  # fmt: skip
    """The kernel compiled for sm_90a. arg_types: Triton type of every runtime argument ("*bf16", "i32", ...);
    aligned: the arguments a launch passes 16-byte aligned (pointers) or divisible by 16 (integers), which Triton
    compiles a kernel of their own for (the one the GPU runs; without, the kernel for unaligned arguments);
    maxnreg: the launch's cap on registers per thread."""
    missing = set(fn.arg_names) - set(arg_types) - set(constexprs)
    assert not missing, f"arguments without a type: {missing}"
    signature = {name: arg_types.get(name, "constexpr") for name in fn.arg_names}
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs={(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned},
    )
    options = {"num_warps": num_warps, "num_stages": num_stages} | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(source, target=H100_H200, options=options)


def compile_for_gpu(fn, arg_types: dict[str, str], constexprs: dict, *, num_warps: int, num_stages: int = 3) -> str:
    """The kernel's PTX for sm_90a (compile_kernel)."""
    return compile_kernel(fn, arg_types, constexprs, num_warps=num_warps, num_stages=num_stages).asm["ptx"]


def machine_code(kernel) -> str | None:
    """The compiled kernel's SASS, by Triton's nvdisasm; None where Triton ships none."""
    nvdisasm = Path(triton.backends.nvidia.__file__).parent / "bin" / "nvdisasm"
    if not nvdisasm.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout


def loads_before_wait(kernel) -> bool:
    """Whether the compiled kernel loads from global memory before its PDL wait: in the machine code ptxas made
    (LDG before ACQBULK, by Triton's nvdisasm), in the PTX where Triton ships no nvdisasm."""
    sass = machine_code(kernel)
    if sass is None:
        head = kernel.asm["ptx"].split("griddepcontrol.wait")[0]
        return "ld.global" in head or "cp.async" in head
    head = sass.split("ACQBULK")[0]
    assert head != sass, "no griddepcontrol.wait (ACQBULK) in the kernel"
    return "LDG" in head


def spill_bytes(kernel) -> int | None:
    """Bytes the compiled kernel spills to local memory (stores + loads), by ptxas -v on its PTX; None where Triton
    ships no ptxas."""
    ptxas = Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas"
    if not ptxas.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        report = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True,
                                text=True, check=True).stderr  # fmt: skip
    found = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert found, report
    return int(found.group(1)) + int(found.group(2))


def _norm_meta(hidden, world, has_residual, weight_fp32):
    return dict(
        H=hidden,
        BLOCK_H=rms_norm.block_h(hidden),
        RANK=world - 1,
        WORLD=world,
        HAS_RESIDUAL=has_residual,
        WEIGHT_FP32=weight_fp32,
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    "hidden,world,has_residual,weight_fp32", [(4096, 2, True, False), (5120, 4, False, True), (8192, 8, True, True)]
)
def test_fused_all_reduce_rms_norm_kernels_compile(dtype, hidden, world, has_residual, weight_fp32):
    p = PTR[dtype]
    tensors = dict(x_ptr=p, res_ptr=p, w_ptr=p, h_ptr=p, y_ptr=p)
    meta = _norm_meta(hidden, world, has_residual, weight_fp32)
    warps = rms_norm.num_warps_for(hidden)
    ptx = compile_for_gpu(
        triton_ar_norm._all_reduce_rms_norm_kernel,
        {
            **tensors,
            "buffer_ptrs": "i64",
            "signal_pad_ptrs": "i64",
            "num_rows": "i32",
            "eps": "fp32",
            "timeout_ms": "i32",
        },
        meta,
        num_warps=warps,
    )
    # the timed waits and the trap are in the kernel (a dead peer stops it instead of hanging the GPU)
    assert "%globaltimer" in ptx and "trap;" in ptx and "atom.global.release.sys.cas.b32" in ptx
    bits, sentinel = triton_ar_norm._SENTINEL[2 if dtype == "bfloat16" else 4]
    ptx = compile_for_gpu(
        triton_ar_norm._all_reduce_rms_norm_ll_kernel,
        {
            **tensors,
            "buffer_ptrs": "i64",
            "calls_ptr": "*i32",
            "num_rows": "i32",
            "slot_numel": "i32",
            "eps": "fp32",
            "timeout_ms": "i32",
        },
        {**meta, "BITS": triton_ar_norm._TL_BITS[bits], "SENTINEL": sentinel},
        num_warps=warps,
    )
    assert "%globaltimer" in ptx and "trap;" in ptx and "ld.volatile.global" in ptx


@pytest.mark.parametrize("has_s2", [False, True])
def test_add_rms_norm_kernel_compiles(has_s2):
    p = PTR["bfloat16"]
    compile_for_gpu(
        rms_norm._add_rms_norm_kernel,
        dict(s_ptr=p, s2_ptr=p, res_ptr=p, w_ptr=p, h_ptr=p, y_ptr=p, eps="fp32"),
        dict(H=4096, BLOCK_H=4096, HAS_S2=has_s2, HAS_RESIDUAL=True, WEIGHT_FP32=False),
        num_warps=8,
    )


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("group,head_dim", [(4, 128), (8, 128), (1, 64)])
def test_paged_decode_kernels_compile(group, head_dim, split):
    fn = paged_decode._decode_kernel
    ptrs = dict(q_ptr="*bf16", kn_ptr="*bf16", vn_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", slot_ptr="*i64")
    ptrs.update(tables_ptr="*i32", ctx_ptr="*i32", o_ptr="*fp32" if split else "*bf16", lse_ptr="*fp32")
    scalars = dict(scale="fp32", block_size="i32", tokens_per_split="i32")
    strides = {name: "i32" for name in fn.arg_names if name.startswith("stride_")}
    tuning = paged_decode.DEFAULT_TUNING
    meta = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim)
    meta.update(BLOCK=tuning.block_n, SPLIT=split, PREFETCH=tuning.prefetch, PDL=split)
    ptx = compile_for_gpu(fn, {**ptrs, **scalars, **strides}, meta, num_warps=tuning.num_warps)
    assert ("griddepcontrol.wait" in ptx) == split
    if split:  # the first K/V tile loads before the wait; nothing does without prefetch
        for prefetch in (False, True):
            kernel = compile_kernel(fn, {**ptrs, **scalars, **strides}, meta | {"PREFETCH": prefetch}, num_warps=4)
            assert loads_before_wait(kernel) == prefetch
    merge = paged_decode._merge_kernel
    strides = {name: "i32" for name in merge.arg_names if name.startswith("stride_")}
    types = dict(o_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16", num_splits="i32", **strides)
    compile_for_gpu(merge, types, dict(SPLITS_PAD=8, HEAD_DIM=head_dim, PDL=True), num_warps=4)


@pytest.mark.parametrize("store_kv", [False, True])
@pytest.mark.parametrize("num_q,num_k,head_dim", [(32, 8, 128), (5, 1, 64)])
def test_rope_qk_kernel_compiles(num_q, num_k, head_dim, store_kv):
    from tpweave.ops import rope

    ptrs = dict(q_ptr="*bf16", k_ptr="*bf16", qo_ptr="*bf16", ko_ptr="*bf16", cs_ptr="*fp32", pos_ptr="*i64")
    ptrs |= dict(v_ptr="*bf16", kc_ptr="*bf16", vc_ptr="*bf16", slot_ptr="*i64")
    strides = {name: "i32" for name in rope._rope_qk_kernel.arg_names if name.startswith("stride_")}
    meta = dict(NUM_Q=num_q, NUM_K=num_k, Q_PAD=triton.next_power_of_2(num_q), K_PAD=triton.next_power_of_2(num_k))
    meta |= dict(HEAD_DIM=head_dim, STORE_KV=store_kv, PDL=True)
    ptx = compile_for_gpu(rope._rope_qk_kernel, {**ptrs, **strides}, meta, num_warps=4)
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


@pytest.mark.parametrize(
    "m,n,k,silu_mul", [(1, 4096, 4096, False), (1, 4096, 14336, True), (8, 28672, 4096, False), (64, 6144, 4096, False)]
)
def test_gemv_kernels_compile(m, n, k, silu_mul):
    from tpweave.ops import gemv

    t = gemv.tuning_for(m, n, k, silu_mul=silu_mul)
    types = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", M="i32", N="i32", K="i32", eps="fp32")
    types |= dict(r_ptr="*bf16", g_ptr="*bf16", h_ptr="*bf16")
    types |= {name: "i32" for name in gemv._gemv_kernel.arg_names if name.startswith("stride_")}
    pdl = m == 1  # with and without PDL (ops/pdl.py)
    for norm in (False, True) if m == 1 and not silu_mul else (False,):
        meta = dict(SILU_MUL=silu_mul, NORM=norm, BLOCK_M=gemv.block_m(m), BLOCK_N=t.block_n, BLOCK_K=t.block_k)
        ptx = compile_for_gpu(
            gemv._gemv_kernel, types, {**meta, "PREFETCH": t.prefetch, "PDL": pdl}, num_warps=t.num_warps
        )
        assert ("griddepcontrol.wait" in ptx) == pdl
    if pdl:  # W's first tile loads before the wait, nothing at all without prefetch
        for prefetch in (False, True):
            meta = dict(SILU_MUL=silu_mul, NORM=False, BLOCK_M=1, BLOCK_N=t.block_n, BLOCK_K=t.block_k)
            kernel = compile_kernel(gemv._gemv_kernel, types, {**meta, "PREFETCH": prefetch, "PDL": True}, num_warps=4)
            assert loads_before_wait(kernel) == prefetch
    types = dict(x_ptr="*bf16", out_ptr="*bf16", K="i32", stride_xm="i32")
    compile_for_gpu(gemv._silu_mul_kernel, types, dict(BLOCK=1024, PDL=pdl), num_warps=4)


@pytest.mark.parametrize("wait", [False, True])
def test_emulated_signal_kernel_compiles(wait):
    import emulated_ranks

    ptx = compile_for_gpu(
        emulated_ranks._signal_kernel, dict(slot_ptr="*i32", timeout_ms="i32"), dict(WAIT=wait), num_warps=1
    )
    assert ("acquire" if wait else "release") in ptx


def test_every_tpweave_kernel_is_compiled_here():
    """A new @triton.jit kernel (a function whose name ends in _kernel) must get a compile test above."""
    import importlib
    import inspect
    import pkgutil

    import tpweave

    tested = {
        "_all_reduce_rms_norm_kernel",
        "_all_reduce_rms_norm_ll_kernel",
        "_add_rms_norm_kernel",
        "_decode_kernel",
        "_merge_kernel",
        "_rope_qk_kernel",
        "_gemv_kernel",
        "_silu_mul_kernel",
        "_flash_prefill_kernel",
        "_paged_prefill_kernel",
        "_invariant_matmul_kernel",
        "_invariant_matmul_tma_kernel",
        "_tree_matmul_kernel",
        "_grouped_matmul_kernel",
        "_invariant_attention_kernel",
        "_merge_chunks_kernel",
        "_argmax_slices_kernel",
        "_argmax_rows_kernel",
    }
    found = set()
    for info in pkgutil.walk_packages(tpweave.__path__, "tpweave."):
        if info.name.endswith("__main__"):  # runs the CLI
            continue
        module = importlib.import_module(info.name)
        found |= {
            name
            for name, obj in inspect.getmembers(module)
            if isinstance(obj, triton.runtime.jit.JITFunction)
            and name.endswith("_kernel")
            and obj.__module__ == info.name
        }
    assert found == tested, found ^ tested


@pytest.mark.parametrize("group,head_dim", [(4, 128), (1, 64), (8, 128)])
def test_flash_prefill_kernel_compiles(group, head_dim):
    """The prefill attention kernel compiles for sm_90 at its default launch setting, waiting for the kernel before
    it under PDL and using the tensor cores' warpgroup MMA (wgmma) for both products."""
    from tpweave.ops import flash_prefill

    fn, t = flash_prefill._flash_prefill_kernel, flash_prefill.DEFAULT_TUNING
    types = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*bf16", cu_ptr="*i32", num_seqs="i32")
    types |= dict(qk_scale="fp32") | {name: "i32" for name in fn.arg_names if name.startswith("stride_")}
    meta = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=t.block_m, BLOCK_N=t.block_n, PDL=True)
    ptx = compile_for_gpu(fn, types, meta, num_warps=t.num_warps, num_stages=t.num_stages)
    assert "griddepcontrol.wait" in ptx and "wgmma.mma_async" in ptx


@pytest.mark.parametrize(
    "group,head_dim,block_m,pack",
    [(4, 128, 64, False), (4, 128, 16, True), (4, 128, 128, False), (1, 64, 64, False), (8, 256, 16, True),
     (5, 128, 16, True)],
)  # fmt: skip
def test_paged_prefill_kernel_compiles(group, head_dim, block_m, pack):
    """The paged prefill kernel compiles for sm_90 at each of its row blocks (GQA packed in the short ones), waiting
    under PDL and using the tensor cores: warpgroup MMA (wgmma) at 64 rows and more, mma.sync at 16 (below a
    warpgroup's 64)."""
    from tpweave.ops import flash_prefill

    fn = flash_prefill._paged_prefill_kernel
    tunings = {
        16: flash_prefill.SHORT_ROWS_TUNING,
        64: flash_prefill.DEFAULT_TUNING,
        128: flash_prefill.LONG_ROWS_TUNING,
    }
    t = tunings[block_m]
    types = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*bf16", cu_ptr="*i32", ctx_ptr="*i32")
    types |= dict(tables_ptr="*i32", num_seqs="i32", min_q="i32", max_q="i32", qk_scale="fp32", block_size="i32")
    types |= {name: "i32" for name in fn.arg_names if name.startswith("stride_")}
    seq_blocks = 1 if pack else 0  # the short launch's mapping of programs to sequences, the general one otherwise
    meta = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=t.block_m, BLOCK_N=t.block_n, PACK_GQA=pack,
                SEQ_BLOCKS=seq_blocks, PDL=True)  # fmt: skip
    ptx = compile_for_gpu(fn, types, meta, num_warps=t.num_warps, num_stages=t.num_stages)
    assert "griddepcontrol.wait" in ptx and ("wgmma.mma_async" if block_m >= 64 else "mma.sync.aligned") in ptx


@pytest.mark.parametrize("has_bias", [False, True])
def test_invariant_matmul_kernel_compiles(has_bias):
    """The batch-invariant matmul at each of its launch shapes, on the tensor cores' warpgroup MMA from 64 rows and
    mma.sync below, under PDL with no load before its wait; every launch shape `tiling_for` picks is one compiled
    here or in the TMA kernel's test."""
    from tpweave.ops import invariant_kernels as ik

    fn = ik._invariant_matmul_kernel
    types = dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", bias_ptr="*bf16", M="i32", N="i32", K="i32")
    types |= dict(beta="fp32", alpha="fp32") | {name: "i32" for name in fn.arg_names if name.startswith("stride_")}
    for t in ik.TILINGS:
        meta = dict(HAS_BIAS=has_bias, SCALED=has_bias, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                    GROUP_M=t.group_m, PDL=True)  # fmt: skip
        kernel = compile_kernel(fn, types, meta, num_warps=t.num_warps, num_stages=t.num_stages)
        ptx = kernel.asm["ptx"]
        assert ("wgmma.mma_async" in ptx) == (t.block_m >= 64) and ("mma.sync" in ptx) == (t.block_m < 64), t
        assert not loads_before_wait(kernel), t
    shapes = itertools.product((1, 16, 17, 32, 33, 64, 65, 128, 200, 256, 300, 512, 513, 2048, 8192),
                               (1024, 4096, 6144, 28672), (1024, 4096, 14336))  # fmt: skip
    assert {ik.tiling_for(m, n, k) for m, n, k in shapes} <= {*ik.TILINGS, *ik.TMA_TILINGS}
    assert {ik.bmm_tiling_for(m) for m, _, _ in shapes} <= set(ik.TILINGS)  # the batched product's: pointer tiles


def test_invariant_matmul_tma_kernel_compiles():
    """The TMA candidates of the batch-invariant matmul (ik.TMA_TILINGS; B as a transposed weight and as (K, N), with
    the bias epilogue): TMA loads, the pointer kernel's warpgroup MMA instructions (m64 x the tile's columns x k16),
    no load before the PDL wait."""
    import re

    from tpweave.ops import invariant_kernels as ik

    fn = ik._invariant_matmul_tma_kernel
    types = dict(c_ptr="*bf16", bias_ptr="*bf16", M="i32", N="i32", K="i32", beta="fp32", alpha="fp32")
    types |= {name: "i32" for name in fn.arg_names if name.startswith("stride_")}
    for i, t in enumerate(ik.TMA_TILINGS):
        b_nk = i % 2 == 0
        b_block = [t.block_n, t.block_k] if b_nk else [t.block_k, t.block_n]
        descs = dict(a_desc=f"tensordesc<bf16[{t.block_m}, {t.block_k}]>", b_desc=f"tensordesc<bf16{b_block}>")
        meta = dict(HAS_BIAS=i % 3 == 0, SCALED=i % 3 == 0, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                    GROUP_M=t.group_m, B_NK=b_nk, PERSISTENT=t.persistent, NUM_SMS=132 if t.persistent else 0,
                    WARP_SPECIALIZE=t.warp_specialize, PDL=True)  # fmt: skip
        kernel = compile_kernel(fn, types | descs, meta, num_warps=t.num_warps, num_stages=t.num_stages)
        ptx = kernel.asm["ptx"]
        mma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.bf16\.bf16", ptx))
        assert mma == {f"m64n{t.block_n}k16"}, (t, mma)
        assert "cp.async.bulk.tensor" in ptx, t
        assert not loads_before_wait(kernel), t


def test_tree_matmul_kernel_compiles():
    """The "tp" level's tree product at each number of K chunks, on the tensor cores' warpgroup MMA, under PDL with no
    load before its wait."""
    from tpweave.ops import invariant_kernels

    fn = invariant_kernels._tree_matmul_kernel
    types = dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*fp32", M="i32", N="i32", KC="i32")
    types |= {name: "i32" for name in fn.arg_names if name.startswith("stride_")}
    t = invariant_kernels.TREE_TILING
    for chunks in invariant_kernels.TREE_CHUNKS:
        meta = dict(CHUNKS=chunks, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
                    PDL=True)  # fmt: skip
        kernel = compile_kernel(fn, types, meta, num_warps=t.num_warps, num_stages=t.num_stages)
        assert "wgmma.mma_async" in kernel.asm["ptx"] and not loads_before_wait(kernel)


def test_grouped_matmul_kernel_compiles():
    """The grouped product (a mixture of experts) at its pointer launch shapes and with the tree's K walk: mma.sync
    below 64 rows, warpgroup MMA from 64, no load before the PDL wait (the offsets may be the kernel's just before)."""
    from tpweave.ops import invariant_kernels as ik

    fn = ik._grouped_matmul_kernel
    types = dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", cu_ptr="*i32", num_groups="i32", slots="i32", N="i32",
                 K="i32") | {name: "i32" for name in fn.arg_names if name.startswith("stride_")}  # fmt: skip
    for t, chunks in [*((t, 0) for t in ik.TILINGS), (ik.TREE_TILING, 8)]:
        meta = dict(CHUNKS=chunks, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
                    SEQ_BLOCK=ik.SEQ_BLOCK, PDL=True)  # fmt: skip
        kernel = compile_kernel(fn, types, meta, num_warps=t.num_warps, num_stages=t.num_stages)
        ptx = kernel.asm["ptx"]
        assert ("wgmma.mma_async" in ptx) == (t.block_m >= 64) and ("mma.sync" in ptx) == (t.block_m < 64), t
        assert not loads_before_wait(kernel), t


def _attention_types(fn, index="*i32"):
    """The runtime arguments' types of the invariant attention kernels (sequence offsets and lengths of `index`)."""
    types = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*bf16", cu_ptr=index, ctx_ptr=index)
    types |= dict(tables_ptr="*i32", ws_ml_ptr="*fp32")
    types |= dict(ws_acc_ptr="*fp32", num_seqs="i32", num_tokens="i32", block_size="i32", scale="fp32")
    types |= {name: "i32" for name in fn.arg_names if name.startswith("stride_")}
    return {k: v for k, v in types.items() if k in fn.arg_names}


def _aligned(fn) -> tuple[str, ...]:
    """The arguments a launch passes aligned (pointers, strides, the block size): as the GPU runs the kernel."""
    return tuple(n for n in fn.arg_names if n.endswith("_ptr") or n.startswith("stride_") or n == "block_size")


# SASS opcodes of float arithmetic on values (MUFU.RCP aside: integer division uses it too)
FLOAT_OPS = ("FFMA", "FADD", "FMUL", "FMNMX", "HMMA", "F2FP", "MUFU.EX2")


def float_arithmetic(kernel) -> collections.Counter:
    """How many of each float instruction (FLOAT_OPS) the machine code ptxas made holds (`machine_code`)."""
    sass = machine_code(kernel)
    if sass is None:
        pytest.skip("this Triton ships no nvdisasm: the machine code cannot be read")
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass)
    return collections.Counter(op for op in ops if op.startswith(FLOAT_OPS))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("group,head_dim", [(4, 128), (1, 64), (8, 128)])
def test_invariant_attention_kernel_compiles(group, head_dim, paged):
    """The invariant attention, one program per tile and one per key chunk (both on wgmma at 64 rows), and the chunks'
    merge, under PDL with no load before the wait; at 16 rows on mma.sync, with 1 and 4 sub-tiles a program; with
    64-bit pool offsets and int64 sequence offsets; each plan `launch_for` picks without spills."""
    from tpweave.ops import invariant_kernels as ik

    group_pad = ik._group_pad(group)
    meta = dict(GROUP=group, GROUP_PAD=group_pad, TOKENS=ik.ATTENTION_ROWS // group_pad, HEAD_DIM=head_dim,
                CHUNK=ik.KV_CHUNK, PAGED=paged, SEQ_BLOCK=ik.SEQ_BLOCK, PDL=True, SUB=1)  # fmt: skip
    launch = ik.AttentionLaunch()
    fn = ik._invariant_attention_kernel

    def compiled(index="*i32", **over):
        return compile_kernel(fn, _attention_types(fn, index), meta | dict(SPLIT_K=False, OFF64=False) | over,
                              num_warps=launch.num_warps, num_stages=launch.num_stages)  # fmt: skip

    for split_k in (False, True):
        kernel = compiled(SPLIT_K=split_k)
        assert "wgmma.mma_async" in kernel.asm["ptx"] and not loads_before_wait(kernel)
    subtiles = ((1, False), (4, False), (4, True)) if paged and group == 4 else ((1, False),)
    for sub, split_k in subtiles:  # 16-row products: mma.sync (tests/test_invariant.py)
        ptx = compiled(TOKENS=max(1, 16 // group_pad), SUB=sub, SPLIT_K=split_k).asm["ptx"]
        assert "mma.sync.aligned" in ptx and "wgmma" not in ptx, (sub, split_k)
    if paged and group == 4:  # a pool of 2**31 elements or more; offsets and lengths read as int64 where passed so
        assert "wgmma.mma_async" in compiled(OFF64=True).asm["ptx"]
        assert "wgmma.mma_async" in compiled("*i64").asm["ptx"]
    if paged:  # as launched (aligned pointers, strides and block size): 16-byte async copies of K/V
        aligned = _aligned(fn)
        calls = ((2048, 1), (576, 65), (256, 256), (1, 1))  # (tokens, sequences): a prefill, a mixed step, decodes
        plans = {ik.launch_for(*c, group_pad, head_dim) for c in calls}
        assert {lp.rows for lp in plans} == {ik.ATTENTION_ROWS, max(ik.DECODE_ROWS, group_pad)}
        assert {lp.max_registers for lp in plans} == {None, ik.DECODE_REGISTERS}  # these heads: the decodes capped
        for lp, split_k in itertools.product(plans, (False, True)):
            over = dict(TOKENS=lp.rows // group_pad, SUB=lp.subtiles, SPLIT_K=split_k, OFF64=False)
            kernel = compile_kernel(fn, _attention_types(fn), meta | over, num_warps=lp.num_warps,
                                    num_stages=lp.num_stages, aligned=aligned, maxnreg=lp.max_registers)  # fmt: skip
            assert "cp.async.cg.shared.global" in kernel.asm["ptx"], (lp, split_k)
            assert spill_bytes(kernel) in (0, None), (lp, split_k, spill_bytes(kernel))
            if lp.max_registers:  # the cap reaches ptxas (4 programs of 4 warps an SM: DECODE_REGISTERS)
                assert f".maxnreg {lp.max_registers}" in kernel.asm["ptx"], lp
    fn = ik._merge_chunks_kernel
    for sub in (1, 4) if paged and group == 4 else (1,):
        kernel = compile_kernel(fn, _attention_types(fn), meta | dict(SUB=sub, D_BLOCK=ik.MERGE_COLUMNS, GROUP_LOADS=4),
                                num_warps=4)  # fmt: skip
        assert "ld.global" in kernel.asm["ptx"] and not loads_before_wait(kernel)
    # a decode's tile (16 rows): a group's 16 chunks' loads all issued before the first merge's exp (the loads before
    # it against a group of 4's), without spills
    few = meta | dict(TOKENS=max(1, ik.DECODE_ROWS // group_pad), D_BLOCK=min(head_dim, ik.MERGE_COLUMNS))
    loads = {}
    for group_loads in (4, ik.MERGE_GROUP_FEW_ROWS):
        kernel = compile_kernel(fn, _attention_types(fn), few | dict(GROUP_LOADS=group_loads), num_warps=4)
        loads[group_loads] = kernel.asm["ptx"].split("griddepcontrol.wait")[1].split("ex2.approx")[0].count("ld.global")
        assert spill_bytes(kernel) in (0, None) and not loads_before_wait(kernel)
    # per chunk more: its m, its l and its acc (one vector load or more)
    assert loads[ik.MERGE_GROUP_FEW_ROWS] - loads[4] >= 3 * (ik.MERGE_GROUP_FEW_ROWS - 4), loads


@pytest.mark.parametrize("split_k", [False, True])
def test_attention_register_cap_changes_no_arithmetic(split_k):
    """The decode plan's register cap (ik.DECODE_REGISTERS) changes where ptxas keeps values, not what it computes:
    the capped kernel's machine code holds the same float instructions, FFMA against FMUL + FADD included (a
    contraction of its own would change a row's bits against the uncapped plans)."""
    from tpweave.ops import invariant_kernels as ik

    fn = ik._invariant_attention_kernel
    lp = ik.launch_for(1, 1, 4)
    assert lp.max_registers == ik.DECODE_REGISTERS
    # shapes whose plan spills in DECODE_REGISTERS run uncapped: one q head a kv head, 16, a head dim of 256
    assert {ik.launch_for(1, 1, g, d).max_registers for g, d in ((1, 128), (16, 128), (4, 256))} == {None}
    meta = dict(GROUP=4, GROUP_PAD=4, TOKENS=lp.rows // 4, HEAD_DIM=128, CHUNK=ik.KV_CHUNK, PAGED=True,
                SEQ_BLOCK=ik.SEQ_BLOCK, PDL=True, SUB=1, SPLIT_K=split_k, OFF64=False)  # fmt: skip
    ops = [
        float_arithmetic(
            compile_kernel(
                fn,
                _attention_types(fn),
                meta,
                num_warps=lp.num_warps,
                num_stages=lp.num_stages,
                aligned=_aligned(fn),
                maxnreg=cap,
            )
        )  # fmt: skip
        for cap in (None, lp.max_registers)
    ]
    assert ops[0]["FFMA"] > 0 and ops[0] == ops[1], ops


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("direct", [False, True])
def test_argmax_kernels_compile(dtype, direct):
    """Greedy sampling's argmax: the slices' kernel (writing the winner or the slice's candidate) and the rows' one."""
    from tpweave.ops import argmax

    fn = argmax._argmax_slices_kernel
    types = dict(x_ptr=f"*{dtype}", stride_row="i32", num_cols="i32", cols_per_slice="i32", num_slices="i32")
    types |= dict(val_ptr="*i64" if direct else "*fp32", idx_ptr="*i64" if direct else "*i32", out_ptr="*i64")
    ptx = compile_for_gpu(fn, types, dict(BLOCK=argmax.BLOCK, NONE=argmax._NONE, DIRECT=direct), num_warps=8)
    assert "ld.global" in ptx
    fn = argmax._argmax_rows_kernel
    types = dict(val_ptr="*fp32", idx_ptr="*i32", out_ptr="*i64", num_slices="i32")
    compile_for_gpu(fn, types, dict(SLICES=argmax.MAX_SLICES, NONE=argmax._NONE), num_warps=4)
