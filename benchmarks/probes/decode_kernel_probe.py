"""Sweep the paged decode kernel's launch parameters (ops/paged_decode.py DecodeTuning) on llama3-8b
shapes at TP=1 (32 q heads, 8 kv heads, head dim 128, blocks of 16 tokens in random order) and report
the effective K/V read bandwidth of each, timed inside a CUDA graph of 20 launches.

    python benchmarks/probes/decode_kernel_probe.py [--out FILE.json]
"""

import argparse
import itertools
import json

import torch
import triton.testing

from tpweave.ops import paged_decode
from tpweave.ops.paged_decode import DecodeTuning

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def case(batch: int, context: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    dt = torch.bfloat16
    k_cache = torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=dt, generator=gen)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks - 1, device="cuda", generator=gen)[: batch * blocks_per_seq]
    tables = tables.view(batch, blocks_per_seq).to(torch.int32)
    ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    slots = tables[:, (context - 1) // BLOCK].long() * BLOCK + (context - 1) % BLOCK
    qkv = torch.randn(batch, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=dt, generator=gen)
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    return q, k, v, k_cache, v_cache, slots, tables, ctx


def time_us(fn, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=100, return_mode="median")
    return ms * 1000 / n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    shapes = [(1, 1024), (1, 8192), (16, 1024), (64, 1024), (256, 1024), (64, 4096)]
    grid = [
        DecodeTuning(block_n=bn, num_warps=w, num_stages=s, programs_per_sm=p)
        for bn, w, s, p in itertools.product((32, 64, 128), (4, 8), (1, 2, 3), (2, 4, 8, 16))
    ]
    rows = []
    for batch, context in shapes:
        q, k, v, kc, vc, slots, tables, ctx = case(batch, context)
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
        best = None
        for tuning in grid:
            run = lambda t=tuning: paged_decode.paged_decode(q, k, v, kc, vc, slots, tables, ctx, BLOCK, 0.088, t)  # noqa: E731
            try:
                us = time_us(run)
            except Exception as e:  # out of resources for this config
                print(f"{batch}x{context} {tuning}: {type(e).__name__}")
                continue
            row = dict(batch=batch, context=context, us=us, tb_s=kv_bytes / us / 1e6, **tuning.__dict__)
            rows.append(row)
            if best is None or us < best["us"]:
                best = row
        fields = list(DecodeTuning.__dataclass_fields__)
        default = [
            r
            for r in rows
            if (r["batch"], r["context"]) == (batch, context)
            and DecodeTuning(**{f: r[f] for f in fields}) == paged_decode.DEFAULT_TUNING
        ]
        print(f"batch {batch} context {context}: best {best}")
        if default:
            print(f"   default {default[0]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
