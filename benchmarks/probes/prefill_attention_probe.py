"""Prefill attention of one fresh sequence (llama3-8b heads: 32 q, 8 kv, head dim 128, bf16, causal): cuDNN through
SDPA (kv heads repeated) against FA2 varlen (what ops/attention.py ran before ops/flash_prefill.py). Per length: the
first call (cuDNN builds an execution plan per shape), then the GPU time per call of 20 calls back to back (the host
runs ahead, as in a forward), with the TFLOP/s of the causal half.

    python benchmarks/probes/prefill_attention_probe.py [--out FILE.json]
"""

import argparse
import json
import time

import torch

LENGTHS = (512, 1000, 2048, 2049, 3001, 4096)


def cudnn_sdpa(q, k, v, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, heads, M, D)
    kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)


def fa2_varlen(q, k, v, cu, scale):
    """FA2 varlen through torch (what ops/attention.py ran before ops/flash_prefill.py)."""
    from torch.nn.attention.varlen import varlen_attn

    n = q.shape[0]
    return varlen_attn(q, k, v, cu, cu, n, n, scale=scale, window_size=(-1, 0))


def first_and_steady_ms(fn, calls: int = 20, reps: int = 5) -> tuple[float, float]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = (time.perf_counter() - t) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return first, best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for n in LENGTHS:
        q = torch.randn(n, 32, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        flops = 4 * n * (n + 1) / 2 * 32 * 128
        paths = {
            "cudnn_sdpa": lambda: cudnn_sdpa(q, k, v, 128**-0.5),
            "fa2_varlen": lambda: fa2_varlen(q, k, v, cu, 128**-0.5),
        }
        for name, fn in paths.items():
            first, ms = first_and_steady_ms(fn)
            rows.append(dict(path=name, tokens=n, first_call_ms=round(first, 3), ms=round(ms, 4),
                             tflop_s=round(flops / ms / 1e9, 1)))  # fmt: skip
            print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
