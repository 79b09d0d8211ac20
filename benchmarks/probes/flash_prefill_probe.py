"""Prefill attention kernels and where a prefill forward's time goes.

1. ops/flash_prefill.py's Triton kernel against FA2 varlen (torch) and cuDNN (SDPA, one sequence): the largest
   difference from FA2 on packed batches of varied lengths (GQA, llama3-8b heads: 32 q, 8 kv, head dim 128, bf16),
   then GPU time per call (20 calls back to back) per length and launch setting.
2. The engine's prefill forward of N fresh tokens (llama3-8b, 32 layers) against the matmul roofline, and where its
   time goes (prefetch_probe.prefill_timeline: GPU time by kernel name, idle time between kernels).

    python benchmarks/probes/flash_prefill_probe.py [--out FILE.json] [--model llama3-8b] [--tokens 2048]
"""

import argparse
import json

import torch
from prefill_attention_probe import fa2_varlen

from tpweave.ops import flash_prefill

LENGTHS = (512, 1000, 2048, 4096)
SETTINGS = (
    flash_prefill.PrefillTuning(128, 64, 8, 3),
    flash_prefill.PrefillTuning(128, 64, 4, 3),
    flash_prefill.PrefillTuning(128, 128, 8, 3),
    flash_prefill.PrefillTuning(128, 128, 8, 2),
    flash_prefill.PrefillTuning(128, 32, 4, 3),
    flash_prefill.PrefillTuning(64, 64, 4, 3),
    flash_prefill.PrefillTuning(64, 64, 4, 4),
    flash_prefill.PrefillTuning(64, 64, 4, 2),
    flash_prefill.PrefillTuning(128, 64, 8, 4),
    flash_prefill.PrefillTuning(64, 32, 4, 3),
    flash_prefill.PrefillTuning(64, 64, 8, 3),
)
SCALE = 128**-0.5


def steady_ms(fn, calls: int = 20, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return best


def packed(lens, heads=32, kv_heads=8, dim=128):
    n = sum(lens)
    qkv = torch.randn(n, heads + 2 * kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)  # strided views, as the model's QKV split gives
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu


def cudnn_sdpa(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=SCALE)


def kernel_rows() -> list[dict]:
    rows = []
    for lens in ([2048], [1, 7, 300, 129, 1000, 64], [17] * 60, [4096, 3, 500]):
        q, k, v, cu = packed(lens)
        ref = fa2_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, SCALE).float()
        for tuning in SETTINGS:
            out = flash_prefill.flash_prefill(q, k, v, cu, SCALE, tuning=tuning).float()
            rows.append(dict(check="max_abs_diff_vs_fa2", lens=lens, tuning=str(tuning),
                             diff=(out - ref).abs().max().item(), ref_max=ref.abs().max().item()))  # fmt: skip
            print(rows[-1], flush=True)
    for lens in [[n] for n in LENGTHS] + [[128] * 16, [100, 900, 1048]]:
        q, k, v, cu = packed(lens)
        flops = sum(4 * n * (n + 1) / 2 * 32 * 128 for n in lens)
        qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
        paths = {"fa2_varlen": lambda: fa2_varlen(qc, kc, vc, cu, SCALE)}
        if len(lens) == 1:
            paths["cudnn_sdpa"] = lambda: cudnn_sdpa(qc, kc, vc)
        for tuning in SETTINGS:
            paths[f"triton {tuning}"] = lambda t=tuning: flash_prefill.flash_prefill(q, k, v, cu, SCALE, tuning=t)
        for name, fn in paths.items():
            ms = steady_ms(fn)
            rows.append(dict(path=name, lens=lens, ms=round(ms, 4), tflop_s=round(flops / ms / 1e9, 1)))
            print(rows[-1], flush=True)
    return rows


def forward_modes(engine, num_tokens: int) -> dict:
    """The forward's milliseconds three ways: one call from an idle GPU (the host's time to its first kernel
    included, as bench/engine.py times it), five calls back to back (the host runs ahead), and one CUDA-graph
    replay of it."""
    from tpweave.bench.stats import median
    from tpweave.bench.timing import time_call
    from tpweave.engine.scheduler import ScheduledChunk
    from tpweave.engine.sequence import Sequence

    runner = engine.runner
    seq = Sequence(list(range(1, num_tokens + 1)))
    engine.scheduler.blocks.grow(seq, num_tokens)
    args = runner._inputs([ScheduledChunk(seq, 0, num_tokens, samples=True)])
    with torch.no_grad():
        fwd = lambda: runner.forward(*args)  # noqa: E731
        fwd()
        single = [time_call(fwd, inner=1, on_cuda=True) for _ in range(10)]
        back_to_back = [time_call(fwd, inner=5, on_cuda=True) for _ in range(5)]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fwd()
        replay = [time_call(graph.replay, inner=1, on_cuda=True) for _ in range(10)]
    engine.scheduler.blocks.free(seq)
    return dict(single_call_ms=median(single), back_to_back_ms=median(back_to_back), graph_replay_ms=median(replay))


def forward_breakdown(model: str, num_tokens: int) -> dict:
    """prefetch_probe.prefill_timeline of the engine's forward, with the matmul roofline."""
    from prefetch_probe import prefill_timeline

    from tpweave.bench.engine import gemm_flops_per_s, prefill_flops
    from tpweave.engine import LLMEngine
    from tpweave.runtime.context import TPContext

    ctx = TPContext.single("cuda")
    engine = LLMEngine(ctx, model, max_num_batched_tokens=num_tokens, max_model_len=num_tokens + 8)
    peak = gemm_flops_per_s(ctx.device, torch.bfloat16)
    out = prefill_timeline(engine, num_tokens)
    out |= forward_modes(engine, num_tokens)
    out["matmul_flops_per_s"] = peak
    out["roofline_ms"] = prefill_flops(engine.runner.model, num_tokens) / peak * 1e3
    out["of_roofline"] = out["roofline_ms"] / out["forward_ms"]
    engine.release()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-forward", action="store_true")
    args = parser.parse_args()
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if not args.skip_kernels:
        record["kernels"] = kernel_rows()
    if not args.skip_forward:
        record["forward"] = forward_breakdown(args.model, args.tokens)
        _print_forward(record["forward"])
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)


def _print_forward(f: dict) -> None:
    print({k: v for k, v in f.items() if not isinstance(v, (dict, list))})
    for name, ms in f["by_name_ms"].items():
        print(f"  {ms:8.3f} ms {name}")
    for pair, v in f["gaps_by_neighbours_us"].items():
        print(f"  gaps {v} {pair}")


if __name__ == "__main__":
    main()
