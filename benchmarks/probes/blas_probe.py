"""Decode-size GEMMs of llama3-8b at TP=1 (x (M, K) @ W^T, W (N, K) bf16) under cuBLAS and cuBLASLt
(torch.backends.cuda.preferred_blas_library): time per call inside a CUDA graph of 20 calls, the HBM
bandwidth that is (weights + activations), and the kernels each call launches (a split-K GEMM adds a
reduction kernel).

With --prefill-tokens M: the prefill's GEMMs instead, each library's 32 layers x (qkv, o, gate_up, down) at M rows
(distinct weights per layer) captured in one CUDA graph, the two graphs replayed alternately, in shuffled order,
after --warm replays: what each library sustains under a stream of prefills, with the GPU at its power limit.

    python benchmarks/probes/blas_probe.py [--out FILE.json] [--prefill-tokens 2048 [--warm 30] [--reps 15]]
"""

import argparse
import json
import random
import statistics
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


def prefill_stacks(tokens: int, *, layers: int, warm: int, reps: int) -> list[dict]:
    """Median time of each library's graph of the prefill's GEMMs, replays of the two alternated (module doc)."""
    weights = [
        {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for name, (n, k) in SHAPES.items()}
        for _ in range(layers)
    ]
    x = torch.randn(tokens, 14336, device="cuda", dtype=torch.bfloat16)
    outs = {name: torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16) for name, (n, _) in SHAPES.items()}
    flops = 2 * tokens * layers * sum(n * k for name, (n, k) in SHAPES.items() if name != "lm_head")

    def stack() -> None:
        for layer in weights:
            for name in ("qkv", "o", "gate_up", "down"):
                w = layer[name]
                torch.mm(x[:, : w.shape[1]], w.t(), out=outs[name])

    graphs = {}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        stack()
        torch.cuda.synchronize()
        graphs[lib] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[lib]):
            stack()
        graphs[lib].replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = {lib: [] for lib in graphs}
    rng = random.Random(0)
    for rep in range(warm + reps):
        order = list(graphs)
        rng.shuffle(order)
        for lib in order:
            start.record()
            graphs[lib].replay()
            end.record()
            end.synchronize()
            if rep >= warm:
                samples[lib].append(start.elapsed_time(end))
    rows = []
    for lib, ms in samples.items():
        med = statistics.median(ms)
        torch.backends.cuda.preferred_blas_library(lib)
        rows.append(
            dict(
                lib=lib,
                tokens=tokens,
                layers=layers,
                ms=round(med, 3),
                min_ms=round(min(ms), 3),
                max_ms=round(max(ms), 3),
                tflop_s=round(flops / med / 1e9, 1),
                kernels=kernels(stack),
            )
        )
    return rows


def decode_gemms() -> list[dict]:
    """Each decode-size GEMM at M = 1..256 under each library (module doc)."""
    rows = []
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for m in (1, 8, 64, 256):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                us = time_us(lambda: torch.mm(x, w.t()))
                gbs = (w.numel() + x.numel() + m * n) * 2 / us / 1e3
                rows.append(
                    dict(lib=lib, gemm=name, m=m, us=round(us, 2), gb_s=round(gbs),
                         kernels=kernels(lambda: torch.mm(x, w.t())))
                )  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--prefill-tokens", type=int)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--warm", type=int, default=30)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    if args.prefill_tokens:
        rows = prefill_stacks(args.prefill_tokens, layers=args.layers, warm=args.warm, reps=args.reps)
    else:
        rows = decode_gemms()
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
