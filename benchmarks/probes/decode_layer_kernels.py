"""Probe: per-kernel GPU time of two llama3-8b decoder layers (TP=2, plain graph, CUDA graph replays)
under each all-reduce / all-reduce + norm policy, and the layer time per arm.

    PYTHONPATH=src python benchmarks/probes/decode_layer_kernels.py --tokens 1,8,64
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

import tpweave
from tpweave.bench.layer import LayerStack
from tpweave.bench.timing import time_arms
from tpweave.models import build_model
from tpweave.models.config import get_preset

ARMS = {
    "nccl": {},
    "one_shot": {"all_reduce_policy": "symm_mem_one_shot"},
    "one_shot+norm_kernel": {"all_reduce_rms_norm_policy": "symm_mem_one_shot"},
    "triton_ar_norm": {"all_reduce_rms_norm_policy": "triton_ar_norm"},
}


def kernel_times(fn, num_replays: int = 10) -> dict[str, float]:
    """GPU microseconds per replay of each kernel name, from a profiled run of fn's CUDA graph."""
    from torch.profiler import ProfilerActivity, profile

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_replays):
            graph.replay()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            total[evt.name[:70]] += evt.device_time / num_replays
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


@torch.no_grad()
def work(ctx, tokens: list[int]):
    cfg = get_preset("llama3-8b", num_layers=2)
    model = build_model(cfg, tp=ctx, dtype=torch.bfloat16)
    stack = LayerStack(model.model.layers)
    compiled = {name: tpweave.compile(stack, sp=False, table=None, **kw) for name, kw in ARMS.items()}
    for m in tokens:
        x = torch.randn(m, cfg.hidden_size, device=ctx.device, dtype=torch.bfloat16)
        positions = torch.arange(m, device=ctx.device)
        cu = torch.tensor([0, m], dtype=torch.int32, device=ctx.device)
        fns = {name: (lambda c=c: c(x, positions, cu)) for name, c in compiled.items()}
        timings = time_arms(fns, group=ctx.group, reps=9, warmup=3, inner=5)
        kernels = {name: kernel_times(fn) for name, fn in fns.items()}
        if ctx.rank == 0:
            print(
                f"=== M={m}: us per 2 layers: " + "  ".join(f"{n} {t.median_ms * 1e3:.1f}" for n, t in timings.items()),
                flush=True,
            )
            for name, ks in kernels.items():
                print(f"--- {name}: GPU kernel sum {sum(ks.values()):.1f} us")
                for k, us in list(ks.items())[:14]:
                    print(f"    {us:8.2f}  {k}")
    if ctx.rank == 0:
        print(tpweave.report(compiled["triton_ar_norm"]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,8,64")
    args = parser.parse_args()
    tpweave.launch(work, [int(t) for t in args.tokens.split(",")], nprocs=2, backend="nccl")
