"""Decode-size GEMMs of llama3-8b at TP=1: tpweave's Triton GEMV (ops/gemv.py) over a sweep of launch
parameters against cuBLAS (torch.mm), per shape and row count M. Time per call inside a CUDA graph that cycles
through enough copies of W (> 2x the L2) that every call reads W from HBM, as a decode step does; the best
setting per (shape, M), its HBM bandwidth, cuBLAS's, and the largest error against an fp32 reference.

    python benchmarks/probes/gemv_probe.py [--out FILE.json] [--quick]
"""

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from tpweave.ops.gemv import GemvTuning, gemv

SHAPES = {  # name: (N, K, silu_mul)
    "qkv": (6144, 4096, False),
    "o": (4096, 4096, False),
    "gate_up": (28672, 4096, False),
    "down": (4096, 14336, False),
    "down_silu": (4096, 14336, True),
    "lm_head": (128256, 4096, False),
}
ROWS = (1, 2, 4, 8, 16)  # --rows 32,64 for the tl.dot path at larger M
L2_BYTES = 50 * 2**20


def time_us(fns, reps: int = 10) -> float:
    """Per-call microseconds of the calls fns (one CUDA graph of them all), best of reps replays."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / len(fns))
    return best


def configs(m: int, quick: bool):
    if m == 1:
        grid = itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (1, 2, 3))
    elif m > 16:
        grid = itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4))
    else:
        grid = itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (1, 3, 4))
    for bn, bk, w, s in grid:
        if quick and (w != 4 or s == 1) and m <= 16:
            continue
        yield GemvTuning(block_n=bn, block_k=bk, num_warps=w, num_stages=s)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M, comma-separated")
    parser.add_argument("--gemms", default=",".join(SHAPES), help="which shapes, comma-separated")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    rows_m = [int(v) for v in args.rows.split(",")]
    for name in args.gemms.split(","):
        n, k, silu_mul = SHAPES[name]
        w_bytes = n * k * 2
        copies = max(2, -(-4 * L2_BYTES // w_bytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        calls = max(copies, 24)
        for m in rows_m:
            x = torch.randn(m, 2 * k if silu_mul else k, device="cuda", dtype=torch.bfloat16)
            xin = F.silu(x[:, :k]) * x[:, k:] if silu_mul else x
            ref = (xin.float() @ weights[0].float().t()).to(torch.bfloat16).float()

            def cublas(w):
                if silu_mul:
                    return lambda: (F.silu(x[:, :k]) * x[:, k:]) @ w.t()
                return lambda: x @ w.t()

            cublas_us = time_us([cublas(weights[i % copies]) for i in range(calls)])
            best = None
            for t in configs(m, args.quick):
                try:
                    out = gemv(x, weights[0], silu_mul=silu_mul, tuning=t).float()
                    err = (out - ref).abs().max().item()
                    us = time_us([lambda w=weights[i % copies], t=t: gemv(x, w, silu_mul=silu_mul, tuning=t)
                                  for i in range(calls)])  # fmt: skip
                except Exception as e:  # a setting the compiler refuses (shared memory)
                    print(f"{name} m={m} {t}: {type(e).__name__}")
                    continue
                row = dict(gemm=name, m=m, n=n, k=k, silu_mul=silu_mul, tuning=t.__dict__, us=round(us, 2),
                           gb_s=round(w_bytes / us / 1e3), max_err=err)  # fmt: skip
                rows.append(row)
                if best is None or us < best["us"]:
                    best = row
            cub = dict(gemm=name, m=m, lib="cublas", us=round(cublas_us, 2), gb_s=round(w_bytes / cublas_us / 1e3))
            rows.append(cub)
            print(
                f"{name:10s} m={m:2d}  cublas {cublas_us:7.2f} us {cub['gb_s']:5d} GB/s | "
                f"gemv best {best['us']:7.2f} us {best['gb_s']:5d} GB/s {best['tuning']} err {best['max_err']:.3g}",
                flush=True,
            )
        del weights
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
