"""Probe: M % TP != 0, three ways (issue 4, item 4), TP=2, CUDA graphs, all arms interleaved.

- padded: shards of ceil(M/TP) rows, the last one zero-padded (tpweave's layout); the sequential
  collectives and torch's fused ops work on the padded rows;
- inside the op: tpweave's ce_overlap multiplies only the real rows of the padded shard;
- uneven shards: floor/ceil rows per rank, NCCL's list all-gather / reduce-scatter (no padding rows).
For each M the same ops at the next multiple of TP are timed too, so the cost of the odd M shows.

    PYTHONPATH=src python benchmarks/probes/padding_probe.py --tokens 1023,2047,4095 --out probe.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

import tpweave
from tpweave.bench.timing import time_arms

SITES = {"qkv ag_mm (4096 x 3072)": ("ag_mm", 4096, 3072), "down mm_rs (7168 x 4096)": ("mm_rs", 7168, 4096)}


def _uneven_rows(m: int, world: int) -> list[int]:
    return [m // world + (1 if r < m % world else 0) for r in range(world)]


@torch.no_grad()
def work(ctx, tokens: list[int]):
    dev, dt, ws, group = ctx.device, torch.bfloat16, ctx.world_size, ctx.group_name
    pg = ctx.group
    rows_out = []
    for label, (kind, k, n) in SITES.items():
        w = (torch.randn(n, k, device=dev, dtype=dt) * k**-0.5).t()
        for m_odd in tokens:
            for m in (m_odd, -(-m_odd // ws) * ws):
                rows = -(-m // ws)
                sizes = _uneven_rows(m, ws)
                arms = {}
                if kind == "ag_mm":
                    x = torch.randn(rows, k, device=dev, dtype=dt)
                    x_uneven = torch.randn(sizes[ctx.rank], k, device=dev, dtype=dt)
                    parts = [torch.empty(s, k, device=dev, dtype=dt) for s in sizes]
                    full = torch.empty(m, k, device=dev, dtype=dt)

                    def uneven_ag():
                        dist.all_gather(parts, x_uneven, group=pg)
                        torch.cat(parts, out=full)
                        return full @ w

                    for name in ("sequential", "symm_mem_fused", "ce_overlap"):
                        arms[f"padded {name}" if name != "ce_overlap" else "inside ce_overlap"] = lambda name=name: (
                            torch.ops.tpweave.ag_mm(x, [w], [None], [m], group, ws, name, False)
                        )
                    arms["uneven sequential"] = uneven_ag
                else:
                    a = torch.randn(m, k, device=dev, dtype=dt)
                    out = torch.empty(sizes[ctx.rank], n, device=dev, dtype=dt)

                    def uneven_rs():
                        y = a @ w
                        dist.reduce_scatter(out, list(y.split(sizes)), group=pg)
                        return out

                    for name in ("sequential", "symm_mem_fused", "ce_overlap"):
                        arms[f"padded {name}" if name != "ce_overlap" else "inside ce_overlap"] = lambda name=name: (
                            torch.ops.tpweave.mm_rs(a, w, group, ws, name)
                        )
                    arms["uneven sequential"] = uneven_rs
                timings = time_arms(arms, group=pg, reps=9, warmup=3, inner=5)
                for arm, t in timings.items():
                    rows_out.append(
                        {"site": label, "tokens": m, "odd_of": m_odd, "arm": arm, "ms": t.median_ms, "spread": t.spread}
                    )
                if ctx.rank == 0:
                    print(
                        f"{label} M={m}: " + "  ".join(f"{a} {t.median_ms * 1e3:.1f}us" for a, t in timings.items()),
                        flush=True,
                    )
    return rows_out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1023,2047,4095")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = tpweave.launch(work, [int(t) for t in args.tokens.split(",")], nprocs=2, backend="nccl")[0]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": result}, f, indent=1)
