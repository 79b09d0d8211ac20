"""One decode row through a residual add + RMSNorm and a linear layer, llama3-8b shapes at TP=1: the add + norm
kernel then the GEMV (what the engine runs) against the GEMV that normalizes as it reads (ops/gemv.py:
norm_gemv) over a sweep of launch parameters, and the plain GEMV alone for scale. Per-call time inside one CUDA
graph that cycles through copies of W (> 2x the L2), as gemv_probe.py times.

    python benchmarks/probes/norm_gemv_probe.py [--out FILE.json]
"""

import argparse
import itertools
import json

import torch
from gemv_probe import L2_BYTES, time_us

from tpweave.ops import rms_norm
from tpweave.ops.gemv import GemvTuning, gemv, norm_gemv, tuning_for

SHAPES = {"qkv": (6144, 4096), "gate_up": (28672, 4096)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-2 * L2_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        s, r = torch.randn(1, k, device="cuda", dtype=torch.bfloat16), torch.randn(1, k, device="cuda").bfloat16()
        g = torch.rand(k, device="cuda").bfloat16() + 0.5

        def unfused(w):
            y, _ = rms_norm.add_rms_norm(s, r, g, eps=1e-5, weight_in_fp32=False)
            return gemv(y, w)

        base = time_us([lambda w=w: unfused(w) for w in ws])
        plain = time_us([lambda w=w: gemv(s, w) for w in ws])
        row = dict(shape=name, n=n, k=k, norm_then_gemv_us=base, gemv_alone_us=plain, default=str(tuning_for(1, n, k)))
        fused = []
        for bn, bk, warps, stages in itertools.product((8, 16, 32, 64), (256, 512, 1024), (4,), (2, 3)):
            t = GemvTuning(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
            try:
                us = time_us([lambda w=w: norm_gemv(s, r, g, w, eps=1e-5, tuning=t) for w in ws])
            except Exception as e:  # noqa: BLE001  (a setting the GPU cannot run: shared memory)
                print(name, t, type(e).__name__, flush=True)
                continue
            fused.append(dict(tuning=str(t), us=us))
        fused.sort(key=lambda f: f["us"])
        row |= dict(fused_best_us=fused[0]["us"], fused_best=fused[0]["tuning"], fused=fused)
        rows.append(row)
        print({k_: v for k_, v in row.items() if k_ != "fused"}, "top 3:", fused[:3], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
