"""Small kernels timed under CUDA graph replay (no host launch in the time), llama3-8b shapes on one GPU, bf16.

1. The paged prefill kernel's launch of short sequences (decodes): SEQ_BLOCKS programs per sequence (the mapping
   ops/flash_prefill.py uses) against one program per block of all the step's tokens with the sequence found by
   binary search (the mapping before it), in the cases where the first was measured slower with host launches.
2. Residual add + RMSNorm over (M, 4096): Inductor's kernel for the model's plain ops (models/layers.py's RMSNorm,
   dynamic M, as the engine compiles it) against ops/rms_norm.py's Triton kernel.

Per row: median and spread of GPU time per call over `--reps` replays of a graph of 20 calls.

    python benchmarks/probes/graph_kernels_probe.py [--out FILE.json] [--reps 30]
"""

import argparse
import json
import math

import torch
from flash_prefill_probe import SCALE
from paged_prefill_probe import paged_case

from tpweave.models.layers import RMSNorm
from tpweave.ops import flash_prefill, rms_norm

CALLS = 20


def graph_ms(fn, reps: int) -> list[float]:
    """GPU time per call of fn: a CUDA graph of CALLS calls, replayed reps times (each replay timed by events)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    for _ in range(3):
        graph.replay()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / CALLS)
    return out


def summary(samples: list[float]) -> dict:
    s = sorted(samples)
    return dict(median_ms=round(s[len(s) // 2], 5), min_ms=round(s[0], 5), max_ms=round(s[-1], 5))


def short_launch(q, k_cache, v_cache, cu, ctx, tables, bs, *, per_sequence: bool):
    """The short-sequence launch of paged_prefill (decodes only), with either program mapping."""
    t = flash_prefill.SHORT_ROWS_TUNING
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = tables.shape[0], k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_m = max(t.block_m, 1 << (group - 1).bit_length())
    tokens = block_m // group
    seq_blocks = -(-(flash_prefill.SHORT_ROWS - 1) // tokens) if per_sequence else 0
    programs = num_seqs * seq_blocks if per_sequence else -(-num_tokens // tokens) + num_seqs
    out = torch.empty_like(q)
    flash_prefill._paged_prefill_kernel[(programs, num_kv_heads)](
        q, k_cache, v_cache, out, cu, ctx, tables, num_seqs, 0, flash_prefill.SHORT_ROWS, SCALE * math.log2(math.e),
        bs, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=t.block_n, PACK_GQA=True, SEQ_BLOCKS=seq_blocks,
        PDL=False, num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return out


def short_launch_rows(reps: int) -> list[dict]:
    rows = []
    cases = {
        "64 decodes @1024": ([1] * 64, [1024] * 64),
        "255 decodes @1024": ([1] * 255, [1024] * 255),
        "16 x 128 after 512 + 64 decodes @1024 (short launch only)": ([128] * 16 + [1] * 64, [640] * 16 + [1024] * 64),
        "64 x 3 (speculative) @1024": ([3] * 64, [1024] * 64),
    }
    for name, (q_lens, ctx_lens) in cases.items():
        q, k_cache, v_cache, cu, ctx, tables, bs = paged_case(q_lens, ctx_lens)
        q = q.contiguous()
        outs = {}
        for per_sequence in (True, False):
            args = (q, k_cache, v_cache, cu, ctx, tables, bs)
            outs[per_sequence] = short_launch(*args, per_sequence=per_sequence)
            fn = lambda: short_launch(*args, per_sequence=per_sequence)  # noqa: E731
            rows.append(dict(part="short launch", case=name, mapping="per sequence" if per_sequence else "search",
                             **summary(graph_ms(fn, reps))))  # fmt: skip
            print(rows[-1], flush=True)
        short = torch.tensor(q_lens, device="cuda") < flash_prefill.SHORT_ROWS
        rows_short = torch.repeat_interleave(short, torch.tensor(q_lens, device="cuda"))
        diff = (outs[True][rows_short].float() - outs[False][rows_short].float()).abs().max().item()
        rows.append(dict(part="short launch", case=name, max_abs_diff_between_mappings=diff))
        print(rows[-1], flush=True)
    return rows


def norm_rows(reps: int) -> list[dict]:
    rows = []
    hidden, eps = 4096, 1e-5
    norm = RMSNorm(hidden, eps=eps, dtype=torch.bfloat16, device=torch.device("cuda"))
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, device="cuda") + 0.5)

    def plain(x, r):
        h = x + r
        return norm(h), h

    compiled = torch.compile(plain, dynamic=True, fullgraph=True)
    for m in (1, 64, 256, 2048, 8192):
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        paths = {
            "inductor (plain ops, dynamic M)": lambda: compiled(x, r),
            "tpweave add_rms_norm": lambda: rms_norm.add_rms_norm(x, r, norm.weight, eps=eps, weight_in_fp32=False),
        }
        with torch.no_grad():
            ref = [t.float() for t in plain(x, r)]
            for path, fn in paths.items():
                got = fn()
                diff = max((g.float() - e).abs().max().item() for g, e in zip(got, ref))
                samples = graph_ms(fn, reps)
                gbs = 4 * m * hidden * 2 / (summary(samples)["median_ms"] * 1e-3) / 1e9
                rows.append(dict(part="add + rms_norm", rows=m, path=path, max_abs_diff_vs_eager=diff,
                                 gb_per_s=round(gbs), **summary(samples)))  # fmt: skip
                print(rows[-1], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--reps", type=int, default=30, help="timed graph replays per row")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = short_launch_rows(args.reps) + norm_rows(args.reps)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, calls_per_graph=CALLS, reps=args.reps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
