"""Where an engine step's GPU time goes, default mode against --invariant batch: llama3-8b's first layers (random
weights), decode steps of B sequences at context 1024, a prefill of 2048 tokens and a mixed step (64 decodes and a
fresh chunk of 512 tokens), run eagerly through the compiled model (no CUDA graphs: the kernels are the same) under
torch.profiler; per step, each kernel's GPU time per call, largest first, and the totals. Run it with TPWEAVE_PDL=0
for each kernel's own time: with programmatic dependent launch a kernel starts early and counts its wait for the one
before it (the invariant kernels release their dependents at once).

    python benchmarks/probes/invariant_step_profile.py [--num-layers 4] [--out DIR] [--steps prefill,mixed]
"""

import argparse
import json
from pathlib import Path

import torch
from mixed_host_probe import step_args  # this folder: the decodes-at-context + fresh-chunk step inputs

from tpweave.bench.serve import release_engine
from tpweave.engine import LLMEngine
from tpweave.runtime.context import TPContext

CALLS = 5


def kernel_table(fn) -> tuple[list[dict], float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:120], "us_per_step": e.device_time_total / CALLS, "calls_per_step": e.count / CALLS}
            for e in prof.key_averages() if e.device_time_total > 0]  # fmt: skip
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows, sum(r["us_per_step"] for r in rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--out", default=".")
    p.add_argument("--steps", default="", help="comma-separated words: the steps whose name holds one (all if none)")
    args = p.parse_args()
    steps = {"decode b1": (1, 1024, 0), "decode b64": (64, 1024, 0), "decode b256": (256, 1024, 0),
             "prefill 2048": (0, 0, 2048), "mixed 64x1024 + 512": (64, 1024, 512)}  # fmt: skip
    words = [w for w in args.steps.split(",") if w]
    steps = {name: shape for name, shape in steps.items() if not words or any(w in name for w in words)}
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "num_layers": args.num_layers}
    for mode in (None, "batch"):
        engine = LLMEngine(TPContext.single("cuda"), args.model, num_layers=args.num_layers, max_num_seqs=256,
                           max_num_batched_tokens=2048, max_model_len=2100, cuda_graphs=False, invariant=mode,
                           gpu_memory_utilization=0.5)  # fmt: skip
        with torch.no_grad():
            for name, shape in steps.items():
                inputs = step_args(engine, *shape)
                rows, total = kernel_table(lambda inputs=inputs, runner=engine.runner: runner.forward(*inputs))
                record[f"{mode or 'default'} {name}"] = {"total_us": total, "kernels": rows[:25]}
                print(f"== {mode or 'default'} {name}: {total:.1f} us of kernels per step", flush=True)
                for r in rows[:12]:
                    print(f"  {r['us_per_step']:9.1f} us  x{r['calls_per_step']:<5.0f} {r['kernel']}", flush=True)
        del inputs
        release_engine(engine)
        del engine
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / "invariant_step_profile.json"
    out.write_text(json.dumps(record, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
