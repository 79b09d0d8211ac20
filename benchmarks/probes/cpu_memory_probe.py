"""Memory of ranks building a random-weight model on the CPU, beside what the CLI's check estimates (cli/common.py,
cpu_memory_needed): per rank, the peak resident memory after the build, its parameters and buffers.

    python benchmarks/probes/cpu_memory_probe.py [--model llama3-8b] [--tp 2] [--layers 2 8] [--out FILE.json]
"""

import argparse
import json
import resource

import torch

import tpweave
from tpweave.cli.common import cpu_memory_needed
from tpweave.models import build_model, resolve_config


def build(ctx, model: str, layers: int) -> dict:
    m = build_model(model, tp=ctx, dtype=torch.bfloat16, num_layers=layers)
    return {
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,  # ru_maxrss: KiB on Linux
        "params_gb": sum(p.numel() * p.element_size() for p in m.parameters()) / 1e9,
        "buffers_gb": sum(b.numel() * b.element_size() for b in m.buffers()) / 1e9,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for layers in args.layers:
        cfg = resolve_config(args.model, num_layers=layers)
        estimate, _, _ = cpu_memory_needed(cfg, torch.bfloat16, tp=args.tp, local_ranks=args.tp, random_weights=True)
        ranks = tpweave.launch(build, args.model, layers, nprocs=args.tp, timeout_s=1200)
        rows.append({"layers": layers, "ranks": ranks, "measured_gb": sum(r["peak_rss_gb"] for r in ranks),
                     "estimate_gb": estimate / 1e9})  # fmt: skip
        row = rows[-1]
        print(f"{args.model} with {layers} layers on {args.tp} CPU ranks: peak RSS {row['measured_gb']:.2f} GB in all, "
              f"the check's estimate {row['estimate_gb']:.2f} GB; per rank {ranks}", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "tp": args.tp, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
