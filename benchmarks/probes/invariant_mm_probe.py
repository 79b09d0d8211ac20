"""The batch-invariant Triton matmul (ops/invariant_kernels.py) against cuBLAS (torch.mm) at llama3-8b's TP=1
shapes, and whether other tilings give the same bits: which launch shapes could be picked per M without changing a
row's result (BLOCK_M, BLOCK_N, warps and stages varied; two tilings with another BLOCK_K, to see whether it
changes them).

    python benchmarks/probes/invariant_mm_probe.py [--out DIR]
"""

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from tpweave.bench.stats import median
from tpweave.bench.timing import time_call
from tpweave.ops import invariant_kernels as ik

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (1, 16, 64, 256, 2048)
BASE = ik.MatmulTiling(num_stages=4)
TILINGS = [
    BASE,
    replace(BASE, block_n=128),
    replace(BASE, block_m=128, block_n=128, num_warps=8, num_stages=3),
    replace(BASE, block_n=32),
    replace(BASE, block_m=128, block_n=256, num_warps=8, num_stages=3),
    replace(BASE, num_stages=6),
    replace(BASE, block_k=128, num_stages=4),  # another BLOCK_K: are the bits the same? (informative)
    replace(BASE, block_k=128, block_n=32, num_stages=5),
]
CALLS = 10  # back to back between the events: the kernels' time, not the host's launch


def time_ms(fn, reps=30) -> float:
    for _ in range(3):
        fn()
    return median([time_call(fn, inner=CALLS, on_cuda=True) for _ in range(reps)])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
        x = torch.randn(max(MS), k, device="cuda", generator=g, dtype=torch.bfloat16)
        ref_bits = {}
        for m in MS:
            row = {"shape": name, "n": n, "k": k, "m": m, "cublas_ms": time_ms(lambda: torch.mm(x[:m], w.t()))}
            for i, tiling in enumerate(TILINGS):
                ik.tiling_for = lambda m, k=0, tiling=tiling: tiling
                out = ik.matmul(x[:m], w.t())
                row[f"tiling{i}_ms"] = time_ms(lambda: ik.matmul(x[:m], w.t()))
                ref = ref_bits.setdefault(m, out)
                row[f"tiling{i}_same_bits_as_tiling0"] = bool(torch.equal(out, ref))
                if m > 1:  # row 0 here against row 0 at M = 1 (tiling 0)
                    row[f"tiling{i}_row0_as_m1"] = bool(torch.equal(out[:1], ref_bits[1][:1]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out) / "invariant_mm_probe.json"
    out.write_text(json.dumps({"tilings": [asdict(t) for t in TILINGS], "rows": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
