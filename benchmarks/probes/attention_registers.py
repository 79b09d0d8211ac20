"""Registers a thread, spills and shared memory of the invariant attention kernel's plans as ptxas (Triton's, for
sm_90a) compiles them, per head shape and register cap: no GPU needed. What `DECODE_REGISTERS` and `_capped` in
ops/invariant_kernels.py rest on (4 programs of 4 warps an SM need at most 128 registers a thread).

    PYTHONPATH=src python benchmarks/probes/attention_registers.py      (on a checkout of any commit)
"""

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tpweave.ops import invariant_kernels as ik

HEADS = ((4, 128), (8, 128), (2, 128), (1, 128), (16, 128), (1, 64), (4, 64), (16, 64), (4, 256))  # (group, dim)


def compile_plan(group: int, head_dim: int, rows: int, split_k: bool, cap: int | None):
    fn = ik._invariant_attention_kernel
    types = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*bf16", cu_ptr="*i32", ctx_ptr="*i32",
                 tables_ptr="*i32", ws_ml_ptr="*fp32", ws_acc_ptr="*fp32", num_seqs="i32", num_tokens="i32",
                 block_size="i32", scale="fp32")  # fmt: skip
    types |= {n: "i32" for n in fn.arg_names if n.startswith("stride_")}
    gp = ik._group_pad(group)
    meta = dict(GROUP=group, GROUP_PAD=gp, TOKENS=max(1, rows // gp), HEAD_DIM=head_dim, CHUNK=ik.KV_CHUNK,
                PAGED=True, SEQ_BLOCK=ik.SEQ_BLOCK, PDL=True, SUB=1, SPLIT_K=split_k, OFF64=False)  # fmt: skip
    meta = {k: v for k, v in meta.items() if k in fn.arg_names}  # older commits' kernels take fewer
    aligned = [n for n in fn.arg_names if n.endswith("_ptr") or n.startswith("stride_") or n == "block_size"]
    source = ASTSource(
        fn=fn,
        signature={n: types.get(n, "constexpr") for n in fn.arg_names},
        constexprs={(fn.arg_names.index(k),): v for k, v in meta.items()},
        attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    options = {"num_warps": 4, "num_stages": 2} | ({"maxnreg": cap} if cap else {})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_report(kernel) -> tuple[int, int]:
    ptxas = Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True,
                             text=True, check=True).stderr  # fmt: skip
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = sum(map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out).groups()))
    return regs, spills


def main() -> None:
    cap = getattr(ik, "DECODE_REGISTERS", None)
    print(f"{'group':>5} {'dim':>4} {'rows':>4} {'split':>5} {'cap':>4} {'regs':>4} {'spill B':>7} {'smem B':>7}")
    for group, dim in HEADS:
        for rows in (16, 64):
            for split_k in (False, True):
                for c in (None, cap) if cap and rows == 16 else (None,):
                    k = compile_plan(group, dim, rows, split_k, c)
                    regs, spills = ptxas_report(k)
                    print(f"{group:5d} {dim:4d} {rows:4d} {split_k!s:>5} {c or '-':>4} {regs:4d} {spills:7d} "
                          f"{k.metadata.shared:7d}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
