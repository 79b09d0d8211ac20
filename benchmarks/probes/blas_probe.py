"""Decode-size GEMMs of llama3-8b at TP=1 (x (M, K) @ W^T, W (N, K) bf16) under cuBLAS and cuBLASLt
(torch.backends.cuda.preferred_blas_library): time per call inside a CUDA graph of 20 calls, the HBM
bandwidth that is (weights + activations), and the kernels each call launches (a split-K GEMM adds a
reduction kernel).

    python benchmarks/probes/blas_probe.py [--out FILE.json]
"""

import argparse
import json
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def time_us(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / n)
    return best


def kernels(fn) -> list[str]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return [f"{n} x{c}" for n, c in names.items()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for m in (1, 8, 64, 256):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                us = time_us(lambda: torch.mm(x, w.t()))
                gbs = (w.numel() + x.numel() + m * n) * 2 / us / 1e3
                row = dict(
                    lib=lib,
                    gemm=name,
                    m=m,
                    us=round(us, 2),
                    gb_s=round(gbs),
                    kernels=kernels(lambda: torch.mm(x, w.t())),
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
