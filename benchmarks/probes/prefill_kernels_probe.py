"""Where the engine's prefill forward spends its GPU time: one fresh sequence of N tokens through the compiled
forward (as the engine launches it), profiled over a few calls back to back after --warm-calls more (many: the
clocks the GPU's power limit leaves under a stream of prefills). Per kernel name: launches and GPU time
per call; for every memset and copy the host op that launched it (the innermost profiled op around its runtime
call, and the Python frames with --stack); and the time the GPU sat between kernels.

    python benchmarks/probes/prefill_kernels_probe.py [--model llama3-8b] [--tokens 2048] [--out FILE.json]
        [--stack] [--warm-calls N]
"""

import argparse
import json
import os
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from tpweave.bench.engine import prefill_flops
from tpweave.bench.kernels import categorize
from tpweave.engine import LLMEngine
from tpweave.engine.scheduler import ScheduledChunk
from tpweave.engine.sequence import Sequence
from tpweave.runtime.context import TPContext

CALLS = 3


def _launcher(runtime: dict, host: list[dict]) -> list[str]:
    """Names of the host events (ops, Python frames) around a runtime call on its thread, outermost first."""
    t = runtime["ts"]
    around = [e for e in host if e["tid"] == runtime["tid"] and e["ts"] <= t <= e["ts"] + e.get("dur", 0)]
    return [e["name"] for e in sorted(around, key=lambda e: (e["ts"], -e.get("dur", 0)))]


def profile_forward(fn, *, stack: bool) -> dict:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stack) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    runtime = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    host = [e for e in events if e.get("cat") in ("cpu_op", "python_function")]
    kernels: dict[str, list[float]] = defaultdict(list)
    others: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in device:
        if e["cat"] == "kernel":
            kernels[e["name"]].append(e["dur"])
            continue
        r = runtime.get(e["args"].get("correlation"))
        chain = _launcher(r, host) if r is not None else []
        where = " > ".join(chain[-8:] if stack else chain[-3:])
        others[(e["name"], where)].append(e["dur"])
    device.sort(key=lambda e: e["ts"])
    busy = sum(e["dur"] for e in device)
    span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
    return {
        "span_us_per_call": span / CALLS,
        "device_busy_us_per_call": busy / CALLS,
        "idle_us_per_call": (span - busy) / CALLS,
        "kernels": sorted(
            (
                {
                    "name": n,
                    "kind": categorize(n),
                    "per_call": len(d) / CALLS,
                    "us_per_call": sum(d) / CALLS,
                    "mean_us": sum(d) / len(d),
                }  # fmt: skip
                for n, d in kernels.items()
            ),
            key=lambda r: -r["us_per_call"],
        ),
        "memsets_and_copies": [
            {"name": n, "launched_by": w, "per_call": len(d) / CALLS, "us_per_call": sum(d) / CALLS}
            for (n, w), d in sorted(others.items(), key=lambda kv: -sum(kv[1]))
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--stack", action="store_true", help="Python frames of each memset's launcher")
    parser.add_argument("--warm-calls", type=int, default=3, help="forwards back to back before the profiled ones")
    parser.add_argument("--out")
    args = parser.parse_args()
    ctx = TPContext.single("cuda")
    engine = LLMEngine(ctx, args.model, max_num_batched_tokens=args.tokens, max_model_len=args.tokens + 8)
    runner = engine.runner
    seq = Sequence(list(range(1, args.tokens + 1)))
    engine.scheduler.blocks.grow(seq, args.tokens)
    inputs = runner._inputs([ScheduledChunk(seq, 0, args.tokens, samples=True)])
    with torch.no_grad():
        for _ in range(args.warm_calls):
            runner.forward(*inputs)
        torch.cuda.synchronize()
        result = profile_forward(lambda: runner.forward(*inputs), stack=args.stack)
    engine.scheduler.blocks.free(seq)
    result.update(model=args.model, tokens=args.tokens, flops=prefill_flops(runner.model, args.tokens),
                  warm_calls=args.warm_calls, stack=args.stack)  # fmt: skip
    engine.release()
    print(f"span {result['span_us_per_call'] / 1e3:.2f} ms/call, kernels+memsets busy "
          f"{result['device_busy_us_per_call'] / 1e3:.2f}, idle {result['idle_us_per_call'] / 1e3:.2f}")  # fmt: skip
    for r in result["kernels"]:
        print(f"{r['us_per_call']:9.1f} us {r['per_call']:5.0f}x {r['mean_us']:8.2f} {r['kind']:9s} {r['name'][:90]}")
    for r in result["memsets_and_copies"]:
        print(f"{r['us_per_call']:9.1f} us {r['per_call']:5.0f}x {r['name'][:30]} <- {r['launched_by']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
